"""CUDA AWQ int4 GEMV and dequantize over pyllm's AWQ rows (csrc/common/blocks.h AwqRow, what pyllm/formats/awq/repack.py
repacks AutoAWQ tensors into), against a float64 reference from the layout's definition (cuda_testutil.random_awq_rows:
value = (q - z) * s, codes in the Q4_0 element order) and against the CPU extension's exact dequantizer.
Bounds as tests/gpu/test_gemv.py: exact-activation reference 2e-5 relative, float NMSE 5e-4; dequantize bit-exact.
Odd K/G gives rows of an odd byte count, so most rows start unaligned."""

import numpy as np
import pytest
import torch

from pyllm import _ext
from .cuda_testutil import random_awq_rows as awq_rows

CASES = [(64, 896, 128), (1000, 4096, 128), (37, 2048, 64), (130, 1024, 32), (9, 1280, 256)]  # 896/128 = 7: odd


@pytest.mark.parametrize("M", [1, 2, 8])
@pytest.mark.parametrize("N,Kd,G", CASES)
def test_awq_gemv_matches_float64(K, N, Kd, G, M):
    rows, w64 = awq_rows(N, Kd, G, np.random.default_rng(N + Kd + G + M))
    qtype = int(_ext.load().awq_qtype(G))
    x = torch.randn(M, Kd, device="cuda") * 3
    y = K.cuda_gemv(torch.from_numpy(rows).cuda(), qtype, x).double().cpu().numpy()
    xq, xds = K.cuda_quantize_act(x)
    xdeq = (xq.double().view(M, Kd // 32, 32) * xds[..., 0:1].double()).view(M, Kd).cpu().numpy()
    exact = xdeq @ w64.T
    rel = np.linalg.norm(y - exact) / np.linalg.norm(exact)
    assert rel <= 2e-5, f"AWQ G={G} N={N} K={Kd} M={M}: ||y - W xq|| / ||W xq|| = {rel:.3g}"
    ref = x.double().cpu().numpy() @ w64.T
    nmse = np.sum((y - ref) ** 2) / np.sum(ref ** 2)
    assert nmse <= 5e-4, f"AWQ G={G} N={N} K={Kd} M={M}: NMSE vs float64 = {nmse:.3g}"


@pytest.mark.parametrize("N,Kd,G", CASES[:3])
def test_awq_dequantize_exact(K, N, Kd, G):
    rows, w64 = awq_rows(N, Kd, G, np.random.default_rng(G))
    C = _ext.load()
    qtype = int(C.awq_qtype(G))
    w = torch.from_numpy(rows).cuda()
    out32 = K.cuda_dequantize(w, qtype, Kd, None, False).cpu()
    assert torch.equal(out32, torch.from_numpy(w64.astype(np.float32)))  # (q - z) * s is exact in fp32
    assert torch.equal(out32, C.dequantize(torch.from_numpy(rows), qtype))  # and equal to the CPU decoder
    assert torch.equal(K.cuda_dequantize(w, qtype, Kd, None, True).cpu(), out32.half())
    ids = torch.tensor([N - 1, 0, 3], device="cuda")
    assert torch.equal(K.cuda_dequantize(w, qtype, Kd, ids, False).cpu(), out32[ids.cpu()])
