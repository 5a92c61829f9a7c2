"""Whole-model checks against transformers (float32, same GGUF dequantized by transformers' own loader).

Reference: transformers' LlamaForCausalLM / Qwen2ForCausalLM built from the GGUF (the oracle), fed the same token
ids as pyllm's reference backend (float32 matmul on weights dequantized by pyllm's torch code).
Tolerances: last-position logits max|diff| / max|logit| < 1e-3 and the same argmax; greedy continuations of 32
tokens equal for at least 3 of 4 prompts, and any divergence happens where the reference's top-2 gap < 1e-2.
"""

import pytest
import torch

from conftest import hf_model, pyllm_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "Q: What is 12 * 7?\nA:",
]
KEYS = ["smollm2", "qwen2"]


def ref_llm(key):
    return pyllm_model(key, kernels="reference", n_ctx=512)


@pytest.mark.parametrize("key", KEYS)
def test_last_logits_match_transformers(key):
    llm, hf = ref_llm(key), hf_model(key)
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt)
        ours = llm.logits(ids)[-1].double()
        with torch.no_grad():
            theirs = hf(torch.tensor([ids])).logits[0, -1].double()
        rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        assert ours.argmax() == theirs.argmax(), f"{key} {prompt!r}: argmax differs"
        assert rel < 1e-3, f"{key} {prompt!r}: max|diff|/max|logit| = {rel:.2e}"


@pytest.mark.parametrize("key", KEYS)
def test_all_position_logits_match_transformers(key):
    llm, hf = ref_llm(key), hf_model(key)
    ids = llm.tokenize("Paris is the capital and most populous city of France. It is known for")
    ours = llm.logits(ids).double()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].double()
    rel = ((ours - theirs).abs().amax(-1) / theirs.abs().amax(-1)).max().item()
    assert rel < 1e-3, f"{key}: worst position max|diff|/max|logit| = {rel:.2e}"


def greedy_agreement(llm, hf, prompts, n=32) -> tuple[int, list[str]]:
    """(how many of ``prompts`` continue greedily for ``n`` tokens exactly as transformers' ``hf`` would, the
    failures).  transformers' greedy continuation equals ours exactly when, fed our continuation, its argmax at
    every step is our next token: one teacher-forced forward pass per prompt checks that (hf.generate takes n
    passes, each reading the whole float32 model).  A divergence is allowed only where the reference's top-2 gap
    is below 1e-2 (a near tie, which float32 summation order may break either way)."""
    exact, failures = 0, []
    for prompt in prompts:
        ids = llm.tokenize(prompt)
        ours = list(llm.generate_tokens(ids, max_tokens=n, temperature=0))
        assert ours, f"{prompt!r}: no token generated"
        with torch.no_grad():
            h = hf.model(torch.tensor([ids + ours[:-1]])).last_hidden_state[0, len(ids) - 1:]
            logits = hf.lm_head(h)  # [len(ours), vocab]: the reference's next-token logits after each prefix
        theirs = logits.argmax(-1).tolist()
        diff = next((i for i in range(len(ours)) if ours[i] != theirs[i]), None)
        if diff is None:
            # fewer than n tokens: ours stopped, which transformers does too only at an end-of-generation token
            if len(ours) == n or llm.tokenizer.is_eog(ours[-1]):
                exact += 1
            else:
                failures.append(f"{prompt!r}: stopped after {len(ours)} tokens at a token that ends nothing")
            continue
        top2 = logits[diff].topk(2).values
        gap = (top2[0] - top2[1]).item()
        print(f"{prompt!r}: diverges at token {diff}, reference top-2 gap {gap:.3g}")
        if gap >= 1e-2:
            failures.append(f"{prompt!r}: diverges at token {diff} where the reference's top-2 gap is {gap:.3g}")
    return exact, failures


@pytest.mark.parametrize("key", KEYS)
def test_greedy_matches_transformers(key):
    exact, failures = greedy_agreement(ref_llm(key), hf_model(key), PROMPTS)
    assert not failures, f"{key}: {failures}"
    assert exact >= 3, f"{key}: only {exact}/4 greedy continuations equal transformers'"


@pytest.mark.parametrize("key", KEYS)
def test_prefix_reuse_equals_fresh_evaluation(key):
    """Second call extending the first prompt evaluates only the new tokens and gives the same logits."""
    llm = ref_llm(key)
    a = llm.tokenize("The quick brown fox")
    b = llm.tokenize("The quick brown fox jumps over the lazy dog")
    assert b[:len(a)] == a
    llm.reset()
    list(llm.generate_tokens(a, max_tokens=1, temperature=0))
    assert llm.stats.prompt_evaluated == len(a)
    gen = llm.generate_tokens(b, max_tokens=1, temperature=0)
    tok = next(gen)
    gen.close()
    assert llm.stats.prompt_evaluated == len(b) - len(a)
    fresh = llm.logits(b)[-1]
    assert tok == int(fresh.argmax())


def test_interrupted_generation_keeps_cache_consistent():
    llm = ref_llm("smollm2")
    ids = llm.tokenize("Counting: one, two, three,")
    first = list(llm.generate_tokens(ids, max_tokens=8, temperature=0))
    gen = llm.generate_tokens(ids, max_tokens=8, temperature=0)
    partial = [next(gen) for _ in range(3)]
    gen.close()  # the consumer stops early (as Ctrl-C in the REPL does)
    assert partial == first[:3]
    again = list(llm.generate_tokens(ids, max_tokens=8, temperature=0))
    assert again == first


def test_seeded_sampling_replays():
    llm = ref_llm("smollm2")
    ids = llm.tokenize("My favourite food is")
    a = list(llm.generate_tokens(ids, max_tokens=12, temperature=1.0, seed=7))
    b = list(llm.generate_tokens(ids, max_tokens=12, temperature=1.0, seed=7))
    assert a == b
