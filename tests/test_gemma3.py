"""Gemma 3 270M (Q4_K_M fixture) against transformers' Gemma3ForCausalLM loaded from the same GGUF (float32).

transformers reads gemma3 GGUFs itself (it subtracts the 1 that llama.cpp's converter added to the norm weights),
so the oracle shares no code with pyllm: not the dequantizers, not the norm convention, not the attention masks.
Tolerances as for the llama family (test_model.py): last-position logits max|diff| / max|logit| < 1e-3 with the
same argmax; greedy 32-token continuations equal for at least 3 of 4 prompts, any divergence at a near-tie.
A prompt longer than the 512-token sliding window checks the local/global layer split and the local RoPE base.
"""

import pytest
import torch

from conftest import hf_model, pyllm_model
from test_fast_accuracy import prefill_last_logits
from test_model import greedy_agreement

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "Q: What is 12 * 7?\nA:",
]


def ref_llm():
    return pyllm_model("gemma3", kernels="reference", n_ctx=1024)


def last_logits_hf(hf, ids):
    with torch.no_grad():  # logits_to_keep=1: the 262k-row head only for the last position
        return hf(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].double()


def rel_diff(ours, theirs):
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def test_config_from_metadata():
    cfg = ref_llm().config
    assert (cfg.arch, cfg.n_layer, cfg.head_dim, cfg.sliding_window) == ("gemma3", 18, 256, 512)
    assert cfg.extra["rope_local_base"] == 10000.0 and cfg.rope_base == 1e6
    assert cfg.extra["query_pre_attn_scalar"] == 256 and cfg.tied_output and cfg.qk_norm
    spec = ref_llm().model.spec
    # global layers (every 6th): full attention, rope.freq_base; local ones: a 512 window, the local base
    assert [layer.window == 0 for layer in spec.layers] == [(i + 1) % 6 == 0 for i in range(18)]
    assert {(la.window, la.rope_base) for la in spec.layers} == {(0, 1e6), (512, 10000.0)}
    assert spec.post_norms and spec.act == "gelu_tanh" and spec.attn_scale == 256 ** -0.5
    assert spec.embd_scale == float(torch.tensor(640 ** 0.5, dtype=torch.float32))


def test_last_logits_match_transformers():
    llm, hf = ref_llm(), hf_model("gemma3")
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt)
        assert ids[0] == llm.tokenizer.bos_id
        ours = llm.logits(ids)[-1].double()
        theirs = last_logits_hf(hf, ids)
        rel = rel_diff(ours, theirs)
        print(f"gemma3 {prompt!r}: max|diff|/max|logit| = {rel:.2e}")
        assert ours.argmax() == theirs.argmax(), f"{prompt!r}: argmax differs"
        assert rel < 1e-3, f"{prompt!r}: max|diff|/max|logit| = {rel:.2e}"


def test_long_prompt_crosses_the_sliding_window():
    """640 tokens > window 512: local layers must drop the oldest keys, global layers keep them."""
    llm, hf = ref_llm(), hf_model("gemma3")
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} box holds {i * 7 % 13} coins."
                    for i in range(60))
    ids = llm.tokenize(text)[:640]
    assert len(ids) > llm.config.sliding_window + 100
    ours = prefill_last_logits(llm, ids)  # the 262k-row head for the last position only, as transformers' below
    theirs = last_logits_hf(hf, ids)
    rel = rel_diff(ours, theirs)
    print(f"gemma3 {len(ids)} tokens: max|diff|/max|logit| = {rel:.2e}")
    assert ours.argmax() == theirs.argmax() and rel < 1e-3, f"rel {rel:.2e}"
    # Without the window (all layers global) the result must differ: the test would catch a missing mask.
    m = llm.model
    saved, m.spec = m.spec, m.spec.with_windows(0)
    try:
        unwindowed = prefill_last_logits(llm, ids)
    finally:
        m.spec = saved
    assert rel_diff(unwindowed, theirs) > 10 * max(rel, 1e-5)


def test_greedy_matches_transformers():
    exact, failures = greedy_agreement(ref_llm(), hf_model("gemma3"), PROMPTS)
    assert not failures, failures
    assert exact >= 3, f"only {exact}/4 greedy continuations equal transformers'"


@pytest.mark.parametrize("kv_cache", ["f16"])
def test_decode_through_cache_equals_fresh_prefill(kv_cache):
    """Token-by-token decoding (cache path, windowed masks at start_pos > 0) equals one fresh prefill."""
    llm = ref_llm()
    ids = llm.tokenize("Gemma is a family of lightweight open models")
    llm.reset()
    stepped = [int(t) for t in llm.generate_tokens(ids, max_tokens=6, temperature=0)]
    fresh = llm.logits(ids + stepped[:-1])
    assert [int(x) for x in fresh[len(ids) - 1:].argmax(-1)] == stepped
