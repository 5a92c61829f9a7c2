"""CUDA decode GEMV vs float64 references on gguf.quants-dequantized weights, every type, M = 1..8.

Two references per case:
- exact: W64 @ (the kernel's own int8 activation codes x their scales): only fp32 accumulation differs, so
  ||y - ref|| / ||ref|| <= 2e-5 (catches any indexing error, however small its effect);
- float: W64 @ x64 with x unquantized: NMSE <= 5e-4 (ggml's test_mul_mat bound; the int8 activations cost
  ~1e-5 here), the accuracy the model sees.
"""

import functools

import numpy as np
import pytest
import torch

from pyllm.formats.gguf import BLOCK_INFO, GGMLType
from .cuda_testutil import random_blocks, reference, to_cuda

TYPES = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
SHAPES = [(1, 256), (37, 1024), (1000, 4096), (130, 14336)]


@functools.lru_cache(maxsize=None)
def weights(qtype: GGMLType, n: int, k: int):
    """(blocks on the GPU, their gguf.quants float64 values): shared by the M cases of one weight."""
    blocks = random_blocks(qtype, n, k, np.random.default_rng((int(qtype) * 7919 + n * 31 + k) & 0xFFFF))
    return to_cuda(blocks), reference(qtype, blocks).astype(np.float64)


@pytest.mark.parametrize("M", [1, 2, 5, 8])
@pytest.mark.parametrize("N,Kd", SHAPES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gemv_matches_float64(K, qtype, N, Kd, M):
    w, w64 = weights(qtype, N, Kd)
    x = torch.randn(M, Kd, dtype=torch.float32, device="cuda") * 3
    out = torch.full((M, N), float("nan"), device="cuda")  # poisoned: every element must be written
    y = K.cuda_gemv(w, int(qtype), x, out)
    assert y.data_ptr() == out.data_ptr()
    y64 = y.double().cpu().numpy()
    assert np.isfinite(y64).all(), "unwritten or non-finite outputs"

    xq, xds = K.cuda_quantize_act(x)
    xdeq = (xq.double().view(M, Kd // 32, 32) * xds[..., 0:1].double()).view(M, Kd).cpu().numpy()
    exact = xdeq @ w64.T
    rel = np.linalg.norm(y64 - exact) / np.linalg.norm(exact)
    assert rel <= 2e-5, f"{qtype.name} N={N} K={Kd} M={M}: ||y - W xq|| / ||W xq|| = {rel:.3g}"
    y2 = K.cuda_gemv_q(w, int(qtype), xq, xds)  # the same codes given: the same sums
    assert torch.equal(y2, y)

    if M * N < 32:  # the bound is over a matrix of outputs; one or a few are single draws of the int8 error
        return
    ref = x.double().cpu().numpy() @ w64.T
    nmse = np.sum((y64 - ref) ** 2) / np.sum(ref ** 2)
    assert nmse <= 5e-4, f"{qtype.name} N={N} K={Kd} M={M}: NMSE vs float64 = {nmse:.3g}"


@pytest.mark.parametrize("rows", ["2", "4", "default"])
@pytest.mark.parametrize("N,Kd", [(37, 1024), (1000, 4096)])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gemv_rows_per_cta(K, qtype, N, Kd, rows, monkeypatch):
    """PYLLM_CUDA_GEMV_ROWS=2|4 (and the default, 4) at M = 1 gives PYLLM_CUDA_GEMV_ROWS=1's sums bit for bit (each
    row's slots are added by the same threads in the same order), a last CTA with fewer rows than it holds included
    (N = 37)."""
    w, _ = weights(qtype, N, Kd)
    xq, xds = K.cuda_quantize_act(torch.randn(1, Kd, device="cuda"))
    monkeypatch.setenv("PYLLM_CUDA_GEMV_ROWS", "1")
    want = K.cuda_gemv_q(w, int(qtype), xq, xds)
    if rows == "default":
        monkeypatch.delenv("PYLLM_CUDA_GEMV_ROWS")
    else:
        monkeypatch.setenv("PYLLM_CUDA_GEMV_ROWS", rows)
    got = K.cuda_gemv_q(w, int(qtype), xq, xds, torch.full((1, N), float("nan"), device="cuda"))
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows", ["1", "2", "4"])
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gemv_parts_equal_one_call_each(K, qtype, M, rows, monkeypatch):
    """cuda_gemv_q_parts over 1..3 matrices (q/k/v-like: different row counts, odd ones included) gives each
    matrix's cuda_gemv_q outputs bit for bit: a CTA's part and rows are a function of its index only."""
    monkeypatch.setenv("PYLLM_CUDA_GEMV_ROWS", rows)
    Kd = 1024
    ws = [weights(qtype, n, Kd)[0] for n in (37, 1000, 130)]
    xq, xds = K.cuda_quantize_act(torch.randn(M, Kd, device="cuda"))
    for n_parts in (1, 2, 3):
        outs = [torch.full((M, w.shape[0]), float("nan"), device="cuda") for w in ws[:n_parts]]
        got = K.cuda_gemv_q_parts(ws[:n_parts], int(qtype), xq, xds, outs)
        assert [g.data_ptr() for g in got] == [o.data_ptr() for o in outs]
        for w, g in zip(ws, got):
            assert torch.equal(g, K.cuda_gemv_q(w, int(qtype), xq, xds)), f"{qtype.name} M={M} parts={n_parts}"


def test_gemv_parts_errors(K):
    w = _w(GGMLType.Q4_0)
    xq, xds = K.cuda_quantize_act(torch.randn(1, 256, device="cuda"))
    out = torch.empty(1, 8, device="cuda")
    with pytest.raises(ValueError, match="4 weights; 1..3"):
        K.cuda_gemv_q_parts([w] * 4, int(GGMLType.Q4_0), xq, xds, [out] * 4)
    with pytest.raises(ValueError, match="2 weights but 1 outputs"):
        K.cuda_gemv_q_parts([w, w], int(GGMLType.Q4_0), xq, xds, [out])
    with pytest.raises(ValueError, match=r"outs\[1\] has shape"):
        K.cuda_gemv_q_parts([w, w], int(GGMLType.Q4_0), xq, xds, [out, torch.empty(1, 7, device="cuda")])
    with pytest.raises(ValueError, match=r"ws\[1\] has rows of 272 bytes, but Q4_0 with K=256 needs 144"):
        K.cuda_gemv_q_parts([w, _w(GGMLType.Q8_0)], int(GGMLType.Q4_0), xq, xds, [out, out])


def test_non_finite_activations_give_non_finite_sums(K):
    """A NaN or +-inf among finite activations gets its block a NaN scale and zero codes, so its row's GEMV outputs
    are NaN (not a broken activation rounded into finite codes), and the other rows stay finite: the CPU
    quantizers' rule (tests/test_kernels.py test_a_non_finite_activation_reaches_its_rows_outputs)."""
    w, _ = weights(GGMLType.Q4_K, 37, 1024)
    x = torch.randn(3, 1024, device="cuda")
    for bad in (float("nan"), float("inf"), -float("inf")):
        xs = x.clone()
        xs[1, 300] = bad
        xq, xds = K.cuda_quantize_act(xs)
        assert torch.isnan(xds[1, 300 // 32]).all() and (xq[1, 288:320] == 0).all(), bad
        y = K.cuda_gemv(w, int(GGMLType.Q4_K), xs)
        assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all(), bad


def test_quantize_act_codes(K):
    """int8 codes = round-half-even(x / d), d = max|x| / 127 per 32 values; the (d, d*sum) pairs match."""
    x = torch.randn(3, 4096, device="cuda") * torch.logspace(-3, 3, 4096, device="cuda")
    x[1, :32] = 0  # an all-zero block: d = 0, codes 0
    xq, xds = K.cuda_quantize_act(x)
    xb = x.cpu().view(3, -1, 32)
    d = xb.abs().amax(-1) / 127
    q = torch.where(d[..., None] > 0, torch.round(xb / d[..., None].clamp_min(1e-38)), torch.zeros_like(xb))
    assert torch.equal(xds[..., 0].cpu(), d)
    assert (xq.cpu().view(3, -1, 32).float() - q).abs().max() <= 1  # ties may round either way after /d
    s = xds[..., 1].cpu()
    torch.testing.assert_close(s, d * xq.cpu().view(3, -1, 32).float().sum(-1), rtol=1e-6, atol=0)


def _w(qtype, n=8, k=256):
    return to_cuda(random_blocks(qtype, n, k, np.random.default_rng(0)))


def test_errors(K):
    w = _w(GGMLType.Q4_0)
    x = torch.randn(1, 256, device="cuda")
    with pytest.raises(ValueError, match="M=9"):
        K.cuda_gemv(w, int(GGMLType.Q4_0), torch.randn(9, 256, device="cuda"))
    with pytest.raises(TypeError, match="x must be Float"):
        K.cuda_gemv(w, int(GGMLType.Q4_0), x.half())
    with pytest.raises(ValueError, match="CUDA tensor"):
        K.cuda_gemv(w, int(GGMLType.Q4_0), x.cpu())
    with pytest.raises(ValueError, match="rows of 144 bytes.*needs 162"):  # K=288 needs 9 blocks per row
        K.cuda_gemv(w, int(GGMLType.Q4_0), torch.randn(1, 288, device="cuda"))
    with pytest.raises(ValueError, match="multiple"):
        K.cuda_gemv(w, int(GGMLType.Q4_0), torch.randn(1, 250, device="cuda"))
    with pytest.raises(ValueError, match="Q2_K"):
        K.cuda_gemv(_w(GGMLType.Q2_K), int(GGMLType.Q2_K), x)
    with pytest.raises(ValueError, match="not a GGML type id"):
        K.cuda_gemv(w, 999, x)
    wk = _w(GGMLType.Q4_K, n=4)
    flat = torch.empty(wk.numel() + 1, dtype=torch.uint8, device="cuda")
    mis = flat[1:].view(wk.shape)
    mis.copy_(wk)
    with pytest.raises(ValueError, match="aligned"):
        K.cuda_gemv(mis, int(GGMLType.Q4_K), x)
    with pytest.raises(ValueError, match="out has shape"):
        K.cuda_gemv(w, int(GGMLType.Q4_0), x, torch.empty(1, 7, device="cuda"))
