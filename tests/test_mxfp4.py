"""MXFP4 (gpt-oss's expert weights) as a block type: pyllm's quantizer and reference dequantizer against gguf.quants
(gguf-py's port of ggml's quantize_row_mxfp4_ref / dequantize_row_mxfp4), bit for bit; the C++ kernels (dequantize,
the GEMV on every ISA path this CPU has, the experts' MUL_MAT_ID) against float64 products on the same dequantized
weights, with fresh random inputs each run (seed printed on failure; tolerances: tests/test_kernels.py's, argued
there: TOL_EXACT against x rounded to int8 per 32 as the kernels round it, TOL_Q8 against the plain product)."""

import numpy as np
import pytest
import torch

from pyllm.formats.gguf import BLOCK_INFO, GGMLType
from pyllm.formats.quant import QTensor, dequantize_blocks
from pyllm.formats.quantize import quantize

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402
from gguf import quants  # noqa: E402
from test_kernels import (C, C_all_isas, TOL_EXACT, TOL_Q8, Weight, gemv_on_every_isa,  # noqa: E402,F401 (fixtures)
                          quantize_like_kernels, rel_err, rng_for, why)

MX = GGMLType.MXFP4


def test_block_layout_is_ggmls():
    assert BLOCK_INFO[MX] == (32, 17) == gguf.GGML_QUANT_SIZES[GT.MXFP4]


def varied_rows(rng, n, k):
    """Rows spanning many binades (per-row scales 2^-30 .. 2^30), an all-zero block, negative zeros, and values
    exactly halfway between two codes (the tie rule: the first of equals, best_index_mxfp4)."""
    x = (rng.standard_normal((n, k)) * np.exp2(rng.uniform(-30, 30, (n, 1)))).astype(np.float32)
    x[0, :32] = 0
    x[1, :32] = -0.0
    x[2, :32] = np.float32(2.0) ** np.arange(-8, 24, dtype=np.float32)  # one block, 32 binades
    x[3, :8] = [4, 5, 7, 10, 14, -5, -7, -14]  # with amax 14 (e = 128): halfway between codes 4/6, 6/8, 8/12, ...
    return x


def test_quantizer_is_ggmls_bit_for_bit():
    """Reference: gguf.quants.quantize(MXFP4), gguf-py's vectorized quantize_row_mxfp4_ref."""
    rng = rng_for("mxfp4-quantize")
    x = varied_rows(rng, 96, 320)
    got = quantize(x, MX)
    want = quants.quantize(x, GT.MXFP4)
    assert got.shape == want.shape == (96, 320 // 32 * 17)
    assert np.array_equal(got, want), why("quantize")


def test_dequantizer_is_ggmls_bit_for_bit_on_every_byte():
    """Every exponent byte 0..255 (subnormal 2^-127, 2^-126, normal, the largest) with every code in both nibbles:
    the reference dequantizer (quant.py) gives gguf.quants' bits; so does a round trip through the quantizer."""
    raw = np.zeros((256 * 16, 17), np.uint8)
    raw[:, 0] = np.repeat(np.arange(256), 16)
    codes = np.arange(16, dtype=np.uint8)
    raw[:, 1:] = (np.roll(codes, 1)[None, :] | (codes[None, :] << 4)) ^ np.tile(codes, 256)[:, None]
    got = dequantize_blocks(MX, torch.from_numpy(raw)).numpy()
    with np.errstate(over="ignore"):
        want = quants.dequantize(raw.reshape(-1), GT.MXFP4).reshape(-1)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    x = varied_rows(rng_for("mxfp4-roundtrip"), 8, 64)
    q = quantize(x, MX)
    assert np.array_equal(QTensor(MX, (8, 64), torch.from_numpy(q)).dequantize().numpy().view(np.uint32),
                          quants.dequantize(q, GT.MXFP4).reshape(8, 64).view(np.uint32))


def mxfp4_weight(N, K, key) -> Weight:
    """Random MXFP4 rows (every code, exponents for |w| up to ~1) and W, their gguf.quants dequantization."""
    rng = rng_for("w-mxfp4", N, K, key)
    raw = rng.integers(0, 256, (N * K // 32, 17), dtype=np.uint8)
    raw[:, 0] = rng.integers(118, 126, N * K // 32)
    raw = raw.reshape(N, K // 32 * 17)
    W = quants.dequantize(raw, GT.MXFP4).reshape(N, K).astype(np.float32)
    return Weight(torch.from_numpy(raw), torch.from_numpy(W))


@pytest.mark.parametrize("N,K", [(2880, 64), (64, 2880), (7, 32), (33, 160), (96, 512)])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_gemv_matches_float64_on_every_isa(C, N, K, M):
    """K = 2880 is gpt-oss-20b's n_embd (90 blocks: groups of 8, a half group and single blocks at the row end)."""
    wt = mxfp4_weight(N, K, "gemv")
    x = torch.from_numpy(rng_for("x-mxfp4", N, K, M).standard_normal((M, K), dtype=np.float32))
    xq = quantize_like_kernels(x, 32)
    gemv_on_every_isa(C, "MXFP4", wt.raw, int(MX), x, wt,
                      [(xq @ wt.W64.T, TOL_EXACT, "int8-x float64"), (wt.ref(x), TOL_Q8, "float64")])


def test_dequantize_and_mul_mat_on_every_isa(C):
    """C.dequantize gives gguf.quants' bits (whole tensor and looked-up rows); mul_mat (prefill's path) is the
    float64 product within TOL_Q8 (it may round x as the GEMV does, or dequantize W: either is within it)."""
    wt = mxfp4_weight(48, 256, "deq")
    x = torch.from_numpy(rng_for("x-mm").standard_normal((20, 256), dtype=np.float32))
    ids = torch.tensor([5, 0, 47, 5])
    for isa in C.available_isas():
        C.set_isa(isa)
        assert torch.equal(C.dequantize(wt.raw, int(MX)), wt.W), isa
        assert torch.equal(C.dequantize(wt.raw, int(MX), ids), wt.W[ids]), isa
        err = rel_err(C.mul_mat(x, wt.raw, int(MX)), wt.ref(x), x, wt)
        assert err < TOL_Q8, f"MXFP4 {isa} mul_mat vs float64: {err:.3g} " + why()


@pytest.mark.parametrize("tokens", [1, 40])
def test_experts_gemv_reads_mxfp4_experts(C, tokens):
    """moe_mul_mat (MUL_MAT_ID) over stacked MXFP4 experts [E, N, K]: each selection's row is its expert's float64
    product within TOL_Q8 (1 token: the gathered GEMV; 40: the grouped path)."""
    E, N, K, k = 8, 64, 256, 2
    ws = [mxfp4_weight(N, K, f"e{e}") for e in range(E)]
    w = torch.stack([wt.raw for wt in ws])
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    (y,) = C.moe_mul_mat(x, [w], [int(MX)], ids)
    assert y.shape == (tokens, k, N)
    for t in range(tokens):
        for j in range(k):
            wt = ws[int(ids[t, j])]
            err = rel_err(y[t, j][None], wt.ref(x[t:t + 1]), x[t:t + 1], wt)
            assert err < TOL_Q8, f"token {t} slot {j}: {err:.3g} " + why(tokens)
