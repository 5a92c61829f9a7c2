"""The CPU backend's kernels for a forward's steps besides the matmuls, against float64 written out here.

Attention (``pyllm._C.causal_attention``, csrc/cpu/causal_attention.cpp): T new positions over S >= T keys.

Reference: the causal (optionally sliding-window) grouped-query softmax attention written out in float64 with
torch.einsum on the same float32 inputs, fresh random ones each run (seed printed on failure).  Metric: max|out -
ref| / max|ref|.  The kernel works in float32 (scores, a polynomial e^x within 2 ulp of expf, sums over up to T keys),
so its error is a few float32 ulps of the largest output: seen <= 1.3e-6 for T <= 300 on both paths (torch's
float32 SDPA: <= 1.2e-6).  TOL = 1e-5 leaves 8x room, while a wrong mask, a key off by one, a missing scale or a
softmax over the wrong keys moves outputs by 1e-2 or more.  Every kernel path this machine has runs: 'scalar'
(plain loops) and the vector one that every SIMD ISA uses.

Row operations (``rms_norm``, ``rope_``, ``glu_``: the decode step's row code, csrc/cpu/decode_step.cpp), against
their formulas in float64 on the same float32 inputs; metric max|out - ref| / max|ref|, TOL_ROW = 1e-5 (float32
arithmetic of a few operations per element, and an exp within 2 ulp: seen <= 3e-7).
"""

import os
import time
import zlib

import pytest
import torch

from pyllm import _ext
from pyllm.errors import PyllmError

SEED = int(os.environ.get("PYLLM_TEST_SEED") or time.time_ns() % 2**31)
TOL, TOL_ROW = 1e-5, 1e-5

# (T, S, H, Hkv, head_dim, window): the fixtures' shapes (SmolLM2 9/3 x 64, Qwen2.5 14/2 x 64, Gemma 3 4/1 x 256
# with its 512-key window), one query per KV head, head_dim 8 / 72 (the 8-wide tail panel) and 12 (not a
# multiple of 8: plain loops on every path), T = 1, T below and above a key tile, windows shorter than T; S = T
# (a fresh prompt) and S > T (a later chunk or chat turn over cached keys, one new position included).
SHAPES = [(1, 1, 9, 3, 64, 0), (7, 7, 9, 3, 64, 0), (130, 130, 9, 3, 64, 0), (97, 97, 14, 2, 64, 0),
          (40, 40, 4, 1, 256, 0), (300, 300, 4, 1, 256, 37), (64, 64, 2, 2, 8, 5), (100, 100, 8, 8, 72, 0),
          (50, 50, 6, 3, 12, 0), (33, 33, 4, 2, 16, 1), (1, 77, 9, 3, 64, 0), (5, 40, 14, 2, 64, 0),
          (33, 100, 4, 1, 256, 20), (70, 90, 6, 2, 72, 0), (9, 300, 9, 3, 64, 50)]


@pytest.fixture(scope="module")
def C():
    try:
        mod = _ext.load()
    except PyllmError as e:
        pytest.fail(f"extension unavailable: {e}")
    isa = mod.get_isa()  # the best one, or the one PYLLM_ISA forces for this run: later modules run on it
    yield mod
    mod.set_isa(isa)


def attention_float64(q, k, v, scale, window):
    """q [T, H, hd] at positions S - T.. over k / v [S, Hkv, hd]."""
    T, H, hd = q.shape
    S, G = k.shape[0], H // k.shape[1]
    kd, vd = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = torch.einsum("ihc,jhc->hij", q.double(), kd) * scale
    i, j = torch.arange(S - T, S)[:, None], torch.arange(S)[None, :]
    seen = j <= i
    if window:
        seen &= j > i - window
    p = s.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("hij,jhc->ihc", p, vd).reshape(T, H * hd)


def inputs(*key):
    g = torch.Generator().manual_seed(zlib.crc32(repr((SEED,) + key).encode()))
    T, S, H, Hkv, hd, _ = key[-1]
    # queries 3x the keys' size: sharper softmaxes, where a wrong mask shows most
    return (torch.randn(T, H, hd, generator=g) * 3, torch.randn(S, Hkv, hd, generator=g),
            torch.randn(S, Hkv, hd, generator=g))


def rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("isa", ["scalar", "simd"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-S{}-H{}-Hkv{}-hd{}-w{}".format(*s))
def test_causal_attention_matches_float64(C, isa, shape):
    if isa == "simd":
        simd = [a for a in C.available_isas() if a != "scalar"]
        if not simd:
            pytest.skip("this CPU has no SIMD kernel path (only 'scalar' runs here)")
        isa = simd[-1]
    C.set_isa(isa)
    T, S, H, Hkv, hd, window = shape
    q, k, v = inputs(isa, shape)
    scale = hd ** -0.5
    err = rel_err(C.causal_attention(q, k, v, scale, window), attention_float64(q, k, v, scale, window))
    assert err < TOL, f"{isa} {shape}: max|out - ref| / max|ref| = {err:.2e} (PYLLM_TEST_SEED={SEED})"


def test_causal_attention_reads_strided_layouts(C):
    """q, k, v as column slices of one fused [T, (H + 2 Hkv) hd] projection (rows further apart than their heads),
    and cached keys / values as a KV cache holds them, [Hkv, S, hd], transposed to [S, Hkv, hd]: the same bits as
    contiguous copies."""
    T, H, Hkv, hd = 45, 6, 2, 64
    g = torch.Generator().manual_seed(SEED)
    qkv = torch.randn(T, (H + 2 * Hkv) * hd, generator=g)
    q = qkv[:, :H * hd].view(T, H, hd)
    k = qkv[:, H * hd:(H + Hkv) * hd].view(T, Hkv, hd)
    v = qkv[:, (H + Hkv) * hd:].view(T, Hkv, hd)
    assert not q.is_contiguous()
    out = C.causal_attention(q, k, v, 0.125, 0)
    assert torch.equal(out, C.causal_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.125, 0))
    assert rel_err(out, attention_float64(q, k, v, 0.125, 0)) < TOL
    kc, vc = torch.randn(Hkv, 80, hd, generator=g), torch.randn(Hkv, 80, hd, generator=g)
    q2 = q.contiguous()[:7]
    out = C.causal_attention(q2, kc.transpose(0, 1), vc.transpose(0, 1), 0.125, 0)
    assert torch.equal(out, C.causal_attention(q2, kc.transpose(0, 1).contiguous(), vc.transpose(0, 1).contiguous(),
                                               0.125, 0))
    assert rel_err(out, attention_float64(q2, kc.transpose(0, 1), vc.transpose(0, 1), 0.125, 0)) < TOL


@pytest.mark.parametrize("bad, error, words", [
    (dict(q=torch.zeros(4, 2, 8, dtype=torch.float64)), TypeError, "q must be float32"),
    (dict(k=torch.zeros(4, 3, 8)), ValueError, "do not fit q"),
    (dict(v=torch.zeros(5, 1, 8)), ValueError, "do not fit q"),
    (dict(k=torch.zeros(3, 1, 8), v=torch.zeros(3, 1, 8)), ValueError, "do not fit q"),
    (dict(q=torch.zeros(4, 2)), ValueError, "q must be [positions, heads, head_dim]"),
    (dict(k=torch.zeros(4, 1, 16)[:, :, ::2]), ValueError, "contiguously"),
    (dict(window=-1), ValueError, "window must be >= 0"),
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
])
def test_causal_attention_rejects_bad_arguments(C, bad, error, words):
    args = dict(q=torch.zeros(4, 2, 8), k=torch.zeros(4, 1, 8), v=torch.zeros(4, 1, 8), scale=1.0, window=0)
    args.update(bad)
    with pytest.raises(error, match="causal_attention: .*" + words.replace("[", r"\[").replace("]", r"\]")):
        C.causal_attention(**args)


@pytest.mark.parametrize("isa", ["scalar", "simd"])
@pytest.mark.parametrize("n", [576, 64, 13])
def test_rms_norm_matches_float64(C, isa, n):
    C.set_isa(isa if isa == "scalar" else C.best_isa())
    g = torch.Generator().manual_seed(zlib.crc32(repr((SEED, "rms", n)).encode()))
    x, w = torch.randn(37, 3, n, generator=g) * 4, torch.randn(n, generator=g)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    err = rel_err(C.rms_norm(x, w, 1e-6), ref)
    assert err < TOL_ROW, f"rms_norm n={n}: {err:.2e} (PYLLM_TEST_SEED={SEED})"


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("hd, rope_dim", [(64, 64), (96, 48), (256, 256)])
def test_rope_matches_float64(C, neox, hd, rope_dim):
    """Reference: each pair (x_a, x_b) of the first rope_dim dims as the complex number x_a + i x_b times
    cos + i sin; pairs are (i, i + rope_dim/2) (neox) or (2i, 2i + 1); the other dims pass through."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((SEED, "rope", neox, hd)).encode()))
    T, H, half = 29, 5, rope_dim // 2
    x = torch.randn(T, H, hd, generator=g)
    ang = torch.rand(T, half, generator=g) * 40
    cos, sin = ang.cos(), ang.sin()
    idx = torch.arange(half)
    a, b = (idx, idx + half) if neox else (2 * idx, 2 * idx + 1)
    ref = x.double().clone()
    z = torch.complex(ref[..., a], ref[..., b]) * torch.complex(cos.double(), sin.double())[:, None, :]
    ref[..., a], ref[..., b] = z.real, z.imag
    out = C.rope_(x, cos, sin, rope_dim, neox)
    assert out.data_ptr() == x.data_ptr()  # in place
    err = rel_err(out, ref)
    assert err < TOL_ROW, f"rope neox={neox} hd={hd}: {err:.2e} (PYLLM_TEST_SEED={SEED})"


@pytest.mark.parametrize("isa", ["scalar", "simd"])
@pytest.mark.parametrize("gelu_tanh", [False, True])
def test_glu_matches_float64(C, isa, gelu_tanh):
    C.set_isa(isa if isa == "scalar" else C.best_isa())
    g = torch.Generator().manual_seed(zlib.crc32(repr((SEED, "glu", gelu_tanh)).encode()))
    gate, up = torch.randn(21, 1539, generator=g) * 5, torch.randn(21, 1539, generator=g)  # 1539: a scalar tail
    gd = gate.double()
    act = (0.5 * gd * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gd + 0.044715 * gd ** 3))) if gelu_tanh
           else gd * torch.sigmoid(gd))
    err = rel_err(C.glu_(gate.clone(), up, gelu_tanh), act * up.double())
    assert err < TOL_ROW, f"glu gelu_tanh={gelu_tanh}: {err:.2e} (PYLLM_TEST_SEED={SEED})"


@pytest.mark.parametrize("call, error, words", [
    (lambda C: C.rms_norm(torch.zeros(4, 8), torch.zeros(7), 1e-6), ValueError, "does not end in w's size"),
    (lambda C: C.rms_norm(torch.zeros(4, 8, dtype=torch.float16), torch.zeros(8), 1e-6), TypeError, "x must be Float"),
    (lambda C: C.rope_(torch.zeros(4, 2, 8), torch.zeros(4, 4), torch.zeros(4, 4), 10, True), ValueError, "rope_dim"),
    (lambda C: C.rope_(torch.zeros(4, 2, 8), torch.zeros(3, 4), torch.zeros(3, 4), 8, True), ValueError, "must both be"),
    (lambda C: C.glu_(torch.zeros(4, 8), torch.zeros(4, 9), False), ValueError, "one shape"),
])
def test_row_ops_reject_bad_arguments(C, call, error, words):
    with pytest.raises(error, match=words):
        call(C)
