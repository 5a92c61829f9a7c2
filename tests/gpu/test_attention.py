"""CUDA split-K decode attention vs float64 softmax attention, over GQA layouts, head sizes and lengths that
straddle the 256-position chunks; positions past the length hold NaN and must be ignored."""

import math

import pytest
import torch

CASES = [  # H, Hkv, D, max_seq
    (32, 8, 128, 1000),
    (4, 4, 64, 300),
    (8, 1, 256, 520),
    (14, 2, 64, 700),   # 7 query heads per KV head
    (16, 1, 128, 300),  # 16 per KV head: two CTAs along grid.z
]


@pytest.mark.parametrize("H,Hkv,D,max_seq", CASES)
def test_attn_decode(K, H, Hkv, D, max_seq):
    g = torch.Generator(device="cuda").manual_seed(H * 1000 + D)
    k = torch.randn(Hkv, max_seq, D, device="cuda", generator=g).half()
    v = torch.randn(Hkv, max_seq, D, device="cuda", generator=g).half()
    q = torch.randn(H, D, device="cuda", generator=g) * 2
    scale = 1 / math.sqrt(D)
    for L in sorted({1, 255, 256, 257, max_seq // 2, max_seq}):
        kk, vv = k.clone(), v.clone()
        kk[:, L:] = float("nan")
        vv[:, L:] = float("nan")
        out = K.cuda_attn_decode(q, kk, vv, torch.tensor([L], dtype=torch.int32, device="cuda"), scale)
        k64 = k[:, :L].double().repeat_interleave(H // Hkv, 0)
        v64 = v[:, :L].double().repeat_interleave(H // Hkv, 0)
        p = torch.softmax(torch.einsum("hd,hsd->hs", q.double() * scale, k64), -1)
        ref = torch.einsum("hs,hsd->hd", p, v64)
        err = (out.double() - ref).norm() / ref.norm()
        assert torch.isfinite(out).all(), f"L={L}: non-finite output (masking of positions >= L)"
        assert err <= 1e-4, f"H={H} Hkv={Hkv} D={D} L={L}: relative error {err:.3g}"


def test_attn_errors(K):
    q = torch.randn(8, 128, device="cuda")
    k = torch.zeros(3, 64, 128, device="cuda", dtype=torch.float16)
    n = torch.tensor([4], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="not a multiple of 3"):
        K.cuda_attn_decode(q, k, k, n, 1.0)
    with pytest.raises(ValueError, match="head_dim 96"):
        K.cuda_attn_decode(torch.randn(8, 96, device="cuda"), torch.zeros(2, 8, 96, device="cuda").half(),
                           torch.zeros(2, 8, 96, device="cuda").half(), n, 1.0)
    with pytest.raises(TypeError, match="k must be Half"):
        K.cuda_attn_decode(q, k.float()[:2], k[:2], n, 1.0)
    with pytest.raises(TypeError, match="len must be Int"):
        K.cuda_attn_decode(q, k[:2], k[:2], n.long(), 1.0)
