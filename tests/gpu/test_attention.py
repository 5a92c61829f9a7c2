"""CUDA split-K decode attention vs its float64 definition (tests/gpu/cuda_testutil.py reference_attn_decode:
the stored rows decoded by kv_cache.py's own dequantizers, softmax in float64), over GQA layouts, head sizes,
lengths that straddle the 128-position chunks, every row type for K and V apart, exact sink rows, sliding
windows and logit softcaps.  Positions past the length hold NaN (float rows) and must be ignored.
Tolerance: relative 1e-4 (fp32 accumulation over up to 1000 positions; the rows themselves are exact)."""

import math

import pytest
import torch

from pyllm.backends.cuda_step import AttnPart
from pyllm.runtime import kv_cache
from .cuda_testutil import reference_attn_decode

CASES = [  # H, Hkv, D, max_seq
    (32, 8, 128, 1000),
    (4, 4, 64, 300),
    (8, 1, 256, 520),
    (14, 2, 64, 700),   # 7 query heads per KV head
    (16, 1, 128, 300),  # 16 per KV head: two CTAs along grid.z
]
ROWS = ["f32", "f16", "bf16", "q8_0", "q4_0"]


def make_part(block: str, hkv: int, max_seq: int, d: int, g: torch.Generator, sink: bool) -> AttnPart:
    x = torch.randn(hkv, max_seq, d, device="cuda", generator=g)
    if block in kv_cache.KV_DTYPES:
        data = x.to(kv_cache.KV_DTYPES[block])
        blk = ""
    else:
        part = kv_cache._BlockPart(block, 1, hkv, max_seq, d, "cuda", is_key=False)
        part.write(0, 0, x)
        data, blk = part.data[0], block
    s = torch.randn(hkv, d, device="cuda", generator=g) * 3 if sink else None
    return AttnPart(data.contiguous(), blk, s, None, None, None)


def run(K, q, k, v, L, scale, window=0, softcap=0.0):
    return K.cuda_attn_decode(q, k.data, v.data, torch.tensor([L], dtype=torch.int32, device="cuda"), scale,
                              k.block, v.block, k.sink, v.sink, window, softcap)


def check(out, ref, what):
    assert torch.isfinite(out).all(), f"{what}: non-finite output (masking of positions outside the window)"
    err = float((out.double() - ref).norm() / ref.norm())
    assert err <= 1e-4, f"{what}: relative error {err:.3g}"


@pytest.mark.parametrize("H,Hkv,D,max_seq", CASES)
def test_f16_lengths_and_layouts(K, H, Hkv, D, max_seq):
    g = torch.Generator(device="cuda").manual_seed(H * 1000 + D)
    k, v = (make_part("f16", Hkv, max_seq, D, g, False) for _ in range(2))
    q = torch.randn(H, D, device="cuda", generator=g) * 2
    scale = 1 / math.sqrt(D)
    for L in sorted({1, 127, 128, 129, 255, 256, 257, max_seq // 2, max_seq}):
        kk = AttnPart(k.data.clone(), "", None, None, None, None)
        vv = AttnPart(v.data.clone(), "", None, None, None, None)
        kk.data[:, L:] = float("nan")
        vv.data[:, L:] = float("nan")
        check(run(K, q, kk, vv, L, scale), reference_attn_decode(q, k, v, L, scale), f"H={H} Hkv={Hkv} D={D} L={L}")


@pytest.mark.parametrize("v_rows", ROWS)
@pytest.mark.parametrize("k_rows", ROWS)
def test_every_row_type(K, k_rows, v_rows):
    g = torch.Generator(device="cuda").manual_seed(ROWS.index(k_rows) * 7 + ROWS.index(v_rows))
    H, Hkv, D, S = 8, 2, 128, 600
    k = make_part(k_rows, Hkv, S, D, g, sink=k_rows.startswith("q"))
    v = make_part(v_rows, Hkv, S, D, g, sink=v_rows.startswith("q"))
    q = torch.randn(H, D, device="cuda", generator=g)
    for L in (1, 2, 300, 600):
        check(run(K, q, k, v, L, 0.09), reference_attn_decode(q, k, v, L, 0.09), f"K {k_rows} V {v_rows} L={L}")


@pytest.mark.parametrize("window", [1, 8, 256, 300, 4096])
def test_sliding_window_and_softcap(K, window):
    g = torch.Generator(device="cuda").manual_seed(window)
    H, Hkv, D, S = 8, 4, 256, 900  # Gemma 3 270M: head_dim 256
    k, v = make_part("q8_0", Hkv, S, D, g, True), make_part("q4_0", Hkv, S, D, g, True)
    q = torch.randn(H, D, device="cuda", generator=g) * 4
    for L in (1, window, window + 1, S):
        L = min(L, S)
        for cap in (0.0, 50.0, 2.0):
            check(run(K, q, k, v, L, 1 / 16, window, cap), reference_attn_decode(q, k, v, L, 1 / 16, window, cap),
                  f"window {window} L={L} softcap {cap}")


@pytest.mark.parametrize("D", [64, 128, 256])
def test_output_codes_are_quantize_acts(K, D):
    """With xq / xds the attention also writes its output's int8 codes: bit for bit what cuda_quantize_act makes of
    that output (the output projection's input), whatever the head size."""
    g = torch.Generator(device="cuda").manual_seed(D)
    H, Hkv, S = 8, 2, 300
    k, v = (make_part("f16", Hkv, S, D, g, False) for _ in range(2))
    q = torch.randn(H, D, device="cuda", generator=g)
    length = torch.tensor([S - 3], dtype=torch.int32, device="cuda")
    xq = torch.full((1, H * D), 99, dtype=torch.int8, device="cuda")
    xds = torch.full((1, H * D // 32, 2), float("nan"), device="cuda")
    out = K.cuda_attn_decode(q, k.data, v.data, length, 0.1, "", "", None, None, 0, 0.0, xq, xds)
    assert torch.equal(out, K.cuda_attn_decode(q, k.data, v.data, length, 0.1))
    want_q, want_ds = K.cuda_quantize_act(out.reshape(1, -1))
    assert torch.equal(xq, want_q) and torch.equal(xds, want_ds)
    with pytest.raises(ValueError, match="both xq and xds"):
        K.cuda_attn_decode(q, k.data, v.data, length, 0.1, "", "", None, None, 0, 0.0, xq, None)
    with pytest.raises(ValueError, match="xq has shape"):
        K.cuda_attn_decode(q, k.data, v.data, length, 0.1, "", "", None, None, 0, 0.0, xq[:, :32], xds)


def test_attn_errors(K):
    q = torch.randn(8, 128, device="cuda")
    k = torch.zeros(3, 64, 128, device="cuda", dtype=torch.float16)
    n = torch.tensor([4], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="not a multiple of 3"):
        K.cuda_attn_decode(q, k, k, n, 1.0)
    with pytest.raises(ValueError, match="head_dim 96"):
        K.cuda_attn_decode(torch.randn(8, 96, device="cuda"), torch.zeros(2, 8, 96, device="cuda").half(),
                           torch.zeros(2, 8, 96, device="cuda").half(), n, 1.0)
    with pytest.raises(TypeError, match="k must be Float, Half, BFloat16 or Byte"):
        K.cuda_attn_decode(q, k.double()[:2], k[:2], n, 1.0)
    with pytest.raises(TypeError, match="len must be Int"):
        K.cuda_attn_decode(q, k[:2], k[:2], n.long(), 1.0)
    blocks = torch.zeros(2, 64, 4 * 34, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="block type must be 'q8_0' or 'q4_0'"):
        K.cuda_attn_decode(q, blocks, k[:2], n, 1.0)
    with pytest.raises(ValueError, match=r"expected \[2, 64, 72\]"):
        K.cuda_attn_decode(q, blocks, k[:2], n, 1.0, "q4_0")
    with pytest.raises(ValueError, match="k_sink has shape"):
        K.cuda_attn_decode(q, blocks, k[:2], n, 1.0, "q8_0", "", torch.zeros(2, 64, device="cuda"))
    with pytest.raises(ValueError, match="window=-1"):
        K.cuda_attn_decode(q, k[:2], k[:2], n, 1.0, window=-1)
