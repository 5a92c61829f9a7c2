"""The tiled-layout decode GEMV (csrc/cuda/gemv_tiled.cu over csrc/common/gemv_tiled.h) on the GPU.

References and tolerances:
- bit for bit: the host emulation of the kernel's arithmetic (tests/gemv_tiled_host.cpp, the same header functions,
  every multiply-add an explicit FMA), for each forced K split (1, 2, 4) and the automatic one;
- float64 on the gguf.quants-dequantized weights with the kernel's own int8 codes: ||y - ref|| / ||ref|| <= 2e-5
  (as tests/gpu/test_gemv.py for the GGUF-order kernel), and NMSE <= 5e-4 against the unquantized x;
- the tiled dequantizer (prefill, embedding rows) equals cuda_dequantize on the GGUF rows bit for bit.
AWQ rows (every group size; tests/gpu/cuda_testutil.py random_awq_rows) take the same checks, their float64 weights
(q - z) * s from the rows' definition, their untiled rows read by the row-per-CTA AWQ kernels.
Shapes: the 8B's (N, K) cut to 64-256 rows (every lane and group path; the full sizes run in tools/gpu_check.sh's
benchmark; 136 rows: a last CTA with spare row groups), a last group of fewer lanes (K = 576 / 768), and q/k/v-like
parts of different row counts; for AWQ also K = 896 (7 groups of 128, 3.5 of 256: an odd group count at G 128, so
odd tiles put their scales first).
"""

import functools

import numpy as np
import pytest
import torch

from pyllm.formats.gguf import GGMLType
from .cuda_testutil import random_awq_rows, random_blocks, reference, to_cuda

TYPES = [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K, "AWQ_G32", "AWQ_G64", "AWQ_G128", "AWQ_G256"]
SHAPES = [(64, 4096), (256, 14336), (8, 576), (136, 768), (136, 896)]


def _name(qtype) -> str:
    return getattr(qtype, "name", qtype)


def _group(qtype) -> int:
    """AWQ's group size G (qtype "AWQ_G<G>"), 0 for a GGUF type."""
    return int(qtype[5:]) if isinstance(qtype, str) else 0


def _shapes(qtype):
    unit = 256 if qtype in (GGMLType.Q4_K, GGMLType.Q6_K) else _group(qtype) or 32
    return [(n, k) for n, k in SHAPES if k % unit == 0 and (k != 896 or _group(qtype))]


def rows_type(K, qtype) -> int:
    """The type id of the rows a tiled weight is made from: the GGUF type's, or the extension's AWQ_G<G> id."""
    return int(K.awq_qtype(_group(qtype))) if _group(qtype) else int(qtype)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    from test_gemv_tiled_host import build_host_lib

    return build_host_lib(tmp_path_factory.mktemp("gemv_tiled_gpu"))


@functools.lru_cache(maxsize=None)
def weights(K, qtype, n: int, k: int):
    """(GGUF blocks or AWQ rows numpy, tiled numpy, tiled on the GPU, tiled type id, float64 weights)."""
    base = rows_type(K, qtype)
    rng = np.random.default_rng((base * 7919 + n * 31 + k) & 0xFFFF)
    if _group(qtype):
        blocks, w64 = random_awq_rows(n, k, _group(qtype), rng)
    else:
        blocks = random_blocks(qtype, n, k, rng)
        w64 = reference(qtype, blocks).astype(np.float64)
    tiled = K.cuda_tile_weight(torch.from_numpy(blocks), base, k).numpy()
    return blocks, tiled, to_cuda(tiled), K.cuda_tiled_qtype(base), w64


@pytest.fixture
def auto_split(K):
    yield
    K.cuda_set_gemv_tiled_split(0)


@pytest.mark.parametrize("M", [1, 2, 3, 8])
@pytest.mark.parametrize("qtype", TYPES, ids=_name)
def test_tiled_gemv_matches_emulation_and_float64(K, host, auto_split, qtype, M):
    from test_gemv_tiled_host import emulate

    for n, k in _shapes(qtype):
        blocks, tiled, wt, tid, w64 = weights(K, qtype, n, k)
        assert K.cuda_gemv_supported(tid)
        x = torch.randn(M, k, device="cuda") * 3
        xq, xds = K.cuda_quantize_act(x)
        xq_h, xds_h = xq.cpu().numpy(), xds.cpu().numpy()
        for split in (1, 2, 4, 0):
            K.cuda_set_gemv_tiled_split(split)
            used = split or K.cuda_gemv_tiled_split(tid, n, k, M)
            out = torch.full((M, n), float("nan"), device="cuda")  # poisoned: every element must be written
            y = K.cuda_gemv_q(wt, tid, xq, xds, out)
            assert y.data_ptr() == out.data_ptr()
            got = y.cpu().numpy()
            want = emulate(host, rows_type(K, qtype), tiled, k, xq_h, xds_h, used)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)) or np.array_equal(got, want), \
                f"{_name(qtype)} N={n} K={k} M={M} split {used}: not the host emulation's bits " \
                f"(max diff {np.nanmax(np.abs(got - want)):.3g})"
        y64 = got.astype(np.float64)
        xdeq = (xq_h.astype(np.float64).reshape(M, k // 32, 32) * xds_h[..., :1].astype(np.float64)).reshape(M, k)
        exact = xdeq @ w64.T
        rel = np.linalg.norm(y64 - exact) / np.linalg.norm(exact)
        assert rel <= 2e-5, f"{_name(qtype)} N={n} K={k} M={M}: ||y - W xq|| / ||W xq|| = {rel:.3g}"
        if M * n >= 32:
            ref = x.double().cpu().numpy() @ w64.T
            nmse = np.sum((y64 - ref) ** 2) / np.sum(ref ** 2)
            assert nmse <= 5e-4, f"{_name(qtype)} N={n} K={k} M={M}: NMSE vs float64 = {nmse:.3g}"
        assert torch.equal(K.cuda_gemv(wt, tid, x), K.cuda_gemv_q(wt, tid, xq, xds))


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("qtype", TYPES, ids=_name)
def test_tiled_parts_equal_one_call_each(K, qtype, M):
    """q/k/v-like parts (different row counts, one not a whole CTA) in one launch give each matrix's own sums."""
    k = 2048 if qtype in (GGMLType.Q4_K, GGMLType.Q6_K) else 1024
    ws = [weights(K, qtype, n, k) for n in (136, 1000, 64)]
    tid = ws[0][3]
    xq, xds = K.cuda_quantize_act(torch.randn(M, k, device="cuda"))
    for n_parts in (1, 2, 3):
        outs = [torch.full((M, w[2].shape[0]), float("nan"), device="cuda") for w in ws[:n_parts]]
        got = K.cuda_gemv_q_parts([w[2] for w in ws[:n_parts]], tid, xq, xds, outs)
        for w, g in zip(ws, got):
            assert torch.equal(g, K.cuda_gemv_q(w[2], tid, xq, xds)), f"{_name(qtype)} M={M} parts={n_parts}"


@pytest.mark.parametrize("qtype", TYPES, ids=_name)
def test_tiled_dequantize_equals_gguf(K, qtype):
    n, k = 136, 896 if _group(qtype) in (32, 64, 128) else 768  # AWQ: 7 groups of 128, 3 of 256 (odd counts)
    blocks, _, wt, tid, _ = weights(K, qtype, n, k)
    gguf_rows, base = to_cuda(blocks), rows_type(K, qtype)
    for half in (False, True):
        want = K.cuda_dequantize(gguf_rows, base, k, None, half)
        assert torch.equal(K.cuda_dequantize(wt, tid, k, None, half), want)
    ids = torch.tensor([n - 1, 0, 9, 9, 77], device="cuda")
    want = K.cuda_dequantize(gguf_rows, base, k, ids, False)
    assert torch.equal(K.cuda_dequantize(wt, tid, k, ids, False), want)
    back = K.cuda_tile_weight(torch.from_numpy(np.ascontiguousarray(wt.cpu().numpy())), base, k, inverse=True)
    assert np.array_equal(back.numpy(), blocks)


def test_tiled_errors(K):
    w = torch.from_numpy(random_blocks(GGMLType.Q4_0, 12, 256, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="cannot be tiled"):
        K.cuda_tile_weight(w, int(GGMLType.Q4_0), 256)
    with pytest.raises(ValueError, match="no tiled layout"):
        K.cuda_tile_weight(torch.zeros(8, 20, dtype=torch.uint8), int(GGMLType.Q4_1), 32)
    with pytest.raises(ValueError, match="CPU tensor"):
        K.cuda_tile_weight(w[:8].cuda(), int(GGMLType.Q4_0), 256)
    tid = K.cuda_tiled_qtype(int(GGMLType.Q4_0))
    assert K.cuda_tiled_qtype(int(GGMLType.Q4_1)) == -1
    x = torch.randn(1, 256, device="cuda")
    with pytest.raises(ValueError, match="tiles of 8"):
        K.cuda_gemv(w.cuda(), tid, x)
    with pytest.raises(ValueError, match="split 3"):
        K.cuda_set_gemv_tiled_split(3)


def test_backend_uploads_gemv_matrices_tiled(K, monkeypatch):
    """prepare_weights tiles the matrices a GEMV reads (not an embedding table), PYLLM_CUDA_TILED=0 none; linear,
    linear_output and embed give the same values either way (the GEMV within the int8 codes' float error)."""
    from pyllm.backends import cuda as cb
    from pyllm.formats.quant import QTensor

    b = cb.create("cuda")
    rng = np.random.default_rng(5)
    ws = {n: QTensor(GGMLType.Q4_K, (96, 512), torch.from_numpy(random_blocks(GGMLType.Q4_K, 96, 512, rng)), n)
          for n in ("token_embd.weight", "blk.0.attn_q.weight")}
    up = b.prepare_weights(ws)
    assert isinstance(up["blk.0.attn_q.weight"], cb.CudaTiledTensor)
    assert not isinstance(up["token_embd.weight"], cb.CudaTiledTensor)
    monkeypatch.setenv("PYLLM_CUDA_TILED", "0")
    plain = b.prepare_weights(ws)["blk.0.attn_q.weight"]
    assert not isinstance(plain, cb.CudaTiledTensor)
    tiled = up["blk.0.attn_q.weight"]
    x = torch.randn(3, 512, device="cuda")
    torch.testing.assert_close(b.linear(x, tiled), b.linear(x, plain), rtol=1e-4, atol=1e-4)  # summation order only
    torch.testing.assert_close(b.linear_output(x, tiled), b.linear_output(x, plain), rtol=1e-4, atol=1e-4)
    x40 = torch.randn(40, 512, device="cuda")
    assert torch.equal(b.linear(x40, tiled), b.linear(x40, plain))  # the same fp16 weights through cuBLAS
    ids = torch.tensor([95, 0, 7])
    assert torch.equal(b.embed(tiled, ids), b.embed(plain, ids))
    assert torch.equal(tiled.dequantize(), K.cuda_dequantize(plain.data, int(GGMLType.Q4_K), 512, None, False))


def test_backend_uploads_awq_rows_tiled(K, monkeypatch):
    """AWQ rows a GEMV reads go up tiled (PYLLM_CUDA_TILED=0: as rows); decode through the tiled GEMV (the row kernel's
    sums within summation order), prompt chunks through dequantize + cuBLAS (no MMQ for AWQ: the same fp16 weights,
    so equal), embedding rows and dequantize equal bit for bit."""
    from pyllm.backends import cuda as cb
    from pyllm.formats.awq.repack import AWQRows

    b = cb.create("cuda")
    qt = int(K.awq_qtype(128))
    rows, _ = random_awq_rows(96, 896, 128, np.random.default_rng(6))
    ws = {"blk.0.attn_q.weight": AWQRows(torch.from_numpy(rows), qt, (96, 896), 128, "blk.0.attn_q.weight")}
    tiled = b.prepare_weights(ws)["blk.0.attn_q.weight"]
    assert isinstance(tiled, cb.CudaTiledTensor) and tiled.qtype == K.cuda_tiled_qtype(qt) and tiled.base == qt
    assert not b.mmq_wanted(tiled.qtype)
    monkeypatch.setenv("PYLLM_CUDA_TILED", "0")
    plain = b.prepare_weights(ws)["blk.0.attn_q.weight"]
    assert isinstance(plain, cb.CudaAwqRows)
    x = torch.randn(3, 896, device="cuda")
    torch.testing.assert_close(b.linear(x, tiled), b.linear(x, plain), rtol=1e-4, atol=1e-4)
    x40 = torch.randn(40, 896, device="cuda")
    assert torch.equal(b.linear(x40, tiled), b.linear(x40, plain))
    ids = torch.tensor([95, 0, 7, 8])
    assert torch.equal(b.embed(tiled, ids), b.embed(plain, ids))
    assert torch.equal(tiled.dequantize(), plain.dequantize())
