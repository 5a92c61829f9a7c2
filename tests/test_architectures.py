"""Qwen3, Mistral (sliding window), Llama 3 rope scaling, Phi-3 (fused QKV / gate-up, partial rotary), Gemma 3
(sandwich norms, local/global layers) and SmolLM3 (every 4th layer without rope): tiny random transformers
checkpoints, converted by ``pyllm convert``, loaded by pyllm and compared with transformers on the same token ids.

- f16: the checkpoints hold f16-representable weights, so the file is exact and all-position logits must match
  within 1e-3 relative (max|diff| / max|logit| per position); greedy continuations must be equal.
- q8_0: against transformers running the same q8_0-rounded weights (dequantized with gguf.quants): within 1e-3;
  against the float checkpoint: within 0.1 (measured 0.02-0.06: random tiny models are quantization-sensitive).
- q4_k_m (Q4_K with Q6_K for the head and some attn_v / ffn_down): against transformers on the same rounded
  weights within 1e-3, which ties pyllm's Q4_K/Q6_K quantizers' byte layout to gguf.quants' dequantizers; the
  distance to the float checkpoint (~0.5 on random tiny models) is only bounded (< 1).
"""

import copy

import numpy as np
import pytest
import torch

import tiny_models as tm

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2) # past the window of 8",
]


def rel_per_position(ours, theirs):
    return ((ours - theirs).abs().amax(-1) / theirs.abs().amax(-1)).max().item()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def assert_logits_match(llm, hf, label, tol=1e-3):
    """All-position logits of every prompt within tol of transformers', with the same argmax."""
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt)
        ours, theirs = llm.logits(ids).double(), hf_logits(hf, ids)
        rel = rel_per_position(ours, theirs)
        print(f"{label} {len(ids)} tokens: max rel {rel:.2e}")
        assert rel < tol, f"{label} {prompt!r}: max|diff|/max|logit| = {rel:.2e}"
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_f16_logits_match_transformers(arch):
    assert_logits_match(tm.pyllm_model(arch, "f16"), tm.hf_model(arch), f"{arch} f16")


@pytest.fixture
def fp32_prefill():
    """The fp32 prefill GEMM for one test, as on CPUs without AVX-512 BF16: the bf16 GEMMs round weights and
    activations to 8-bit mantissas (1-2% of the max logit on these random models), which tests/test_prefill_gemm.py
    bounds against float64 on its own."""
    from pyllm import _ext

    C = _ext.load()
    default = C.prefill_kernel()
    C.set_prefill_kernel("f32")
    yield
    C.set_prefill_kernel(default)


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_fast_backend_prefill_matches_transformers(arch, monkeypatch, fp32_prefill):
    """The CPU backend's prefill, whose attention is its own kernel (csrc/cpu/causal_attention.cpp; the second
    prompt runs past Mistral's and Gemma 3's window of 8), against transformers on the f16 file: the same 1e-3
    bound, with the matmuls on the fp32 GEMM (a fresh prompt's first FRESH_ROWS rows over their own keys, the rest
    over the cache).  Then in chunks of 16 tokens: every chunk after the first attends over the (f32) cache, through
    the kernel too."""
    import pyllm
    from pyllm.backends.cpu import CpuBackend

    calls = []
    kernel = CpuBackend.causal_attention
    monkeypatch.setattr(CpuBackend, "causal_attention",
                        staticmethod(lambda *a: calls.append((a[0].shape[0], a[1].shape[0])) or kernel(*a)))
    llm = pyllm.load(str(tm.gguf_path(arch, "f16")), kernels="fast", n_ctx=256, kv_cache="f32")
    hf = tm.hf_model(arch)
    assert_logits_match(llm, hf, f"{arch} fast f16")
    assert calls and calls[0][0] == calls[0][1] > 1 and all(s >= t for t, s in calls), \
        "the prefill did not go through the kernel"
    calls.clear()
    llm.generator.n_batch = 16
    assert_logits_match(llm, hf, f"{arch} fast f16, 16-token chunks")
    assert any(s > t > 1 for t, s in calls), "chunks after the first did not go through the kernel"


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_f16_greedy_matches_transformers(arch):
    llm, hf = tm.pyllm_model(arch, "f16"), tm.hf_model(arch)
    ids = llm.tokenize(PROMPTS[0])
    ours = list(llm.generate_tokens(ids, max_tokens=24, temperature=0))
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, top_k=None, top_p=None,
                          temperature=None, pad_token_id=0, eos_token_id=None)
    theirs = out[0, len(ids):].tolist()
    n = min(len(ours), len(theirs))  # pyllm stops at an end-of-generation token, which it yields
    assert ours[:n] == theirs[:n] and (n == len(theirs) or llm.tokenizer.is_eog(ours[-1]))


def _hf_with_file_weights(arch: str, llm):
    """transformers' model with each matrix rounded to the type the GGUF holds it in (dequantized by gguf.quants)."""
    import gguf

    from pyllm.formats.quantize import quantize

    m = copy.deepcopy(tm.hf_model(arch))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[llm.config.arch.upper()], llm.config.n_layer)
    with torch.no_grad():
        for hf_name, p in m.named_parameters():
            if p.ndim == 2:  # rows keep their blocks under llama's Q/K row permutation, so rounding commutes
                qtype = llm.weights[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))].qtype
                raw = quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qtype)))))
    return m


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_q8_0_logits(arch):
    from pyllm.formats.gguf import GGMLType

    llm = tm.pyllm_model(arch, "q8_0")
    assert {w.qtype for n, w in llm.weights.items() if len(w.shape) == 2} == {GGMLType.Q8_0}
    same = _hf_with_file_weights(arch, llm)
    ids = llm.tokenize(PROMPTS[1])
    ours = llm.logits(ids).double()
    exact = rel_per_position(ours, hf_logits(same, ids))
    vs_float = rel_per_position(ours, hf_logits(tm.hf_model(arch), ids))
    print(f"{arch} q8_0: vs same weights {exact:.2e}, vs float {vs_float:.2e}")
    assert exact < 1e-3 and vs_float < 0.1


@pytest.mark.parametrize("arch", ["llama3", "gemma3", "smollm3"])
def test_q4_k_m_logits(arch):
    from pyllm.formats.gguf import GGMLType

    llm = tm.pyllm_model(arch, "q4_k_m")
    types = {n: w.qtype for n, w in llm.weights.items() if len(w.shape) == 2}
    assert GGMLType.Q4_K in types.values() and GGMLType.Q6_K in types.values(), types
    ids = llm.tokenize(PROMPTS[1])
    ours = llm.logits(ids).double()
    exact = rel_per_position(ours, hf_logits(_hf_with_file_weights(arch, llm), ids))
    vs_float = rel_per_position(ours, hf_logits(tm.hf_model(arch), ids))
    print(f"{arch} q4_k_m: vs same weights {exact:.2e}, vs float {vs_float:.2e}")
    assert exact < 1e-3 and vs_float < 1.0


def test_smollm3_f32_logits_greedy_and_its_no_rope_layer():
    """SmolLM3, a family that is its spec entry (every 4th layer without rope) and its converter mapping: the f32
    file against transformers' float32 forward within 1e-3 with equal greedy tokens, as the f16 file above.  The
    same weights with rope in every layer miss transformers by far more than that bound: the comparison sees the
    NoPE layer."""
    import dataclasses

    from pyllm.models.transformer import Transformer
    from pyllm.runtime.kv_cache import make_kv_cache

    llm, hf = tm.pyllm_model("smollm3", "f32"), tm.hf_model("smollm3")
    assert [la.rope for la in llm.model.spec.layers] == [True, True, True, False]
    assert_logits_match(llm, hf, "smollm3 f32")
    ids = llm.tokenize(PROMPTS[0])
    ours = list(llm.generate_tokens(ids, max_tokens=24, temperature=0))
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, top_k=None, top_p=None,
                          temperature=None, pad_token_id=0, eos_token_id=None)
    assert ours == out[0, len(ids):len(ids) + len(ours)].tolist()

    m = llm.model
    roped = dataclasses.replace(m.spec, layers=tuple(dataclasses.replace(la, rope=True) for la in m.spec.layers))
    wrong = Transformer(m.cfg, m.w, m.backend, 256, spec=roped)
    ids = llm.tokenize(PROMPTS[1])
    kv = make_kv_cache("f32", m.cfg.n_layer, m.cfg.n_kv_head, 256, m.cfg.head_dim)
    rel = rel_per_position(wrong.forward(torch.tensor(ids), 0, kv, all_logits=True).double(), hf_logits(hf, ids))
    assert rel > 0.05, f"rope in every layer is {rel:.2e} from transformers: the test cannot see the NoPE layer"


def test_tokenizer_round_trip_matches_transformers():
    llm, hf_tok = tm.pyllm_model("qwen3", "f16"), tm.tokenizer()
    for text in tm.CORPUS + ["  leading spaces", "tabs\t\tand\nnewlines\n\n", "<|im_start|>user\nhi<|im_end|>", ""]:
        ids = hf_tok(text)["input_ids"]
        assert llm.tokenize(text, add_bos=False) == ids, text
        assert llm.detokenize(ids) == hf_tok.decode(ids)


def test_chat_template_travels():
    llm, hf_tok = tm.pyllm_model("mistral", "f16"), tm.tokenizer()
    msgs = [{"role": "user", "content": "Hello"}]
    assert llm.format_chat(msgs) == hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert llm.tokenizer.is_eog(llm.tokenize("<|im_end|>", add_bos=False)[0])


def test_phi3_fused_tensors_split_without_copies():
    llm = tm.pyllm_model("phi3", "q8_0")
    assert "blk.0.attn_qkv.weight" in llm.gguf.tensors and "blk.0.ffn_gate.weight" not in llm.gguf.tensors
    w = llm.model.w
    fused = llm.weights["blk.0.attn_qkv.weight"].data
    assert w["blk.0.attn_q.weight"].data.data_ptr() == fused.data_ptr()
    assert w["blk.0.attn_k.weight"].data.data_ptr() > fused.data_ptr()
    assert np.prod(w["blk.0.ffn_gate.weight"].shape) == np.prod(w["blk.0.ffn_up.weight"].shape)
