"""The prefill MMQ kernel's arithmetic (csrc/common/mmq.h, which csrc/cuda/mmq.cu runs) on the host: the header's
staging and per-block scaling built with g++ (tests/gemv_tiled_host.cpp) and called through ctypes, on weights tiled
by the production relayout; and the CUDA backend's choice of prefill path.

References and tolerances:
- staging: each row's int8 codes times its per-block scales, in float64 and then rounded to float32, equal the tiled
  dequantizer's values (themselves gguf.quants', tests/test_gemv_tiled_host.py) bit for bit: an index or scale error
  moves whole values;
- the kernel's arithmetic (each 32-value block's exact integer dot, scaled in fp32 and added in block order) against
  float64 on the same dequantized weights:
    * with the same int8 activation codes: ||y - ref|| / ||ref|| <= 2e-5 (fp32 rounding of the scale products and of
      the sum over K <= 14336, ~1e-7 relative; as the decode GEMV's bound), and <= 1e-5 per output relative to the size
      of its terms (no block dropped or counted twice);
    * against the unquantized x: ||y - x W^T|| / ||x W^T|| <= 1.5e-2, the int8 rounding of x (half a step of max|x|/127
      per 32 values: ~0.6% relative for Gaussian x) being what bounds it;
- dispatch: prompt chunks (more than GEMV_MAX_M rows) of a tiled weight go to cuda_mmq where the device takes the type,
  to dequantize + cuBLAS under PYLLM_CUDA_MMQ=0, for weights in GGUF order, and where it does not; decode rows to the
  GEMV.  The kernel takes the GGUF types' tiled layouts and no other (mmq::mmq_type, which cuda_mmq_supported asks):
  tiled AWQ's chunks dequantize.
Inputs are fresh each run (PYLLM_TEST_SEED replays one; each failure prints it).
"""

import types

import numpy as np
import pytest
import torch

from pyllm.formats.gguf import GGMLType
from pyllm.formats.quant import QTensor
from gpu.cuda_testutil import random_blocks
from test_gemv_tiled_host import _ptr, _rng, _why, build_host_lib, quantize_act, relayout

TYPES = [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K]
# (N, K): one block; rows not a multiple of the CTA's 128, with whole K tiles (512) and a short last one (576 =
# 2 x 256 + 64); the 8B's K = 4096 and 14336 (down projection) on a few rows
SHAPES = [(8, 32), (136, 512), (136, 576), (16, 768), (24, 4096), (8, 14336)]
TOKENS = [9, 33, 70]  # above the GEMV's 8 rows; a CTA's 32 or 64 tokens, whole and with a remainder


def _shapes(qtype):
    unit = 256 if qtype in (GGMLType.Q4_K, GGMLType.Q6_K) else 32
    return [(n, k) for n, k in SHAPES if k % unit == 0]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_host_lib(tmp_path_factory.mktemp("mmq"))


def mmq_emulate(lib, qtype, tiled: np.ndarray, k: int, xq: np.ndarray, xds: np.ndarray) -> np.ndarray:
    """The MMQ kernel's y [M, N] for tiled weights and activation codes (xq int8 [M, K], xds float32 [M, K/32, 2])."""
    m, n = xq.shape[0], tiled.shape[0]
    xq, xds = np.ascontiguousarray(xq), np.ascontiguousarray(xds, dtype=np.float32)
    y = np.empty((m, n), dtype=np.float32)
    assert lib.mmq_emulate(int(qtype), _ptr(tiled), n, k, _ptr(xq), _ptr(xds), m, _ptr(y)) == 0
    return y


def staged_values(lib, qtype, tiled: np.ndarray, k: int, n: int) -> np.ndarray:
    """Row n's values as the kernel's staged codes and Metas stand for them, in float64."""
    codes = np.empty(k, dtype=np.int8)
    meta = np.empty((k // 32, 2), dtype=np.uint32)
    assert lib.mmq_stage_row(int(qtype), _ptr(tiled), k, n, _ptr(codes), _ptr(meta)) == 0
    d = meta[:, 0].view(np.float32).astype(np.float64)
    c = codes.astype(np.float64).reshape(-1, 32)
    if qtype == GGMLType.Q4_K:
        return (d[:, None] * c - meta[:, 1].view(np.float32).astype(np.float64)[:, None]).reshape(-1)
    if qtype == GGMLType.Q6_K:
        aux = meta[:, 1]
        sc = np.stack([(aux & 0xFF).astype(np.uint8).view(np.int8), ((aux >> 8) & 0xFF).astype(np.uint8).view(np.int8)],
                      -1).astype(np.float64)
        return (d[:, None] * np.repeat(sc, 16, axis=1) * c).reshape(-1)
    return (d[:, None] * c).reshape(-1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_staged_codes_and_scales_give_the_dequantized_weights(lib, qtype):
    for n, k in _shapes(qtype):
        blocks = np.ascontiguousarray(random_blocks(qtype, n, k, _rng("mmq-stage", qtype, n, k)))
        tiled = relayout(lib, qtype, blocks, k)
        want = np.empty((n, k), dtype=np.float32)
        assert lib.tiled_dequantize(int(qtype), _ptr(tiled), n, k, _ptr(want)) == 0
        for row in range(n):
            got = staged_values(lib, qtype, tiled, k, row).astype(np.float32)
            assert np.array_equal(got.view(np.uint32), want[row].view(np.uint32)), \
                _why(qtype.name, n, k, f"row {row}", f"first differing value {np.argmax(got != want[row])}")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_arithmetic_matches_float64(lib, qtype):
    for n, k in _shapes(qtype):
        for m in TOKENS:
            rng = _rng("mmq", qtype, n, k, m)
            blocks = np.ascontiguousarray(random_blocks(qtype, n, k, rng))
            tiled = relayout(lib, qtype, blocks, k)
            w64 = np.empty((n, k), dtype=np.float32)
            assert lib.tiled_dequantize(int(qtype), _ptr(tiled), n, k, _ptr(w64)) == 0
            w64 = w64.astype(np.float64)
            x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, size=(m, 1))).astype(np.float32)
            xq, xds = quantize_act(x)
            y = mmq_emulate(lib, qtype, tiled, k, xq, xds).astype(np.float64)
            xdeq = (xq.astype(np.float64).reshape(m, k // 32, 32) * xds[..., :1].astype(np.float64)).reshape(m, k)
            ref = xdeq @ w64.T
            rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
            assert rel <= 2e-5, _why(qtype.name, n, k, f"M={m}", f"||y - W xq|| / ||W xq|| = {rel:.3g}")
            worst = np.max(np.abs(y - ref) / (np.abs(xdeq) @ np.abs(w64).T + 1e-30))
            assert worst <= 1e-5, _why(qtype.name, n, k, f"M={m}", f"worst per-output error {worst:.3g}")
            exact = x.astype(np.float64) @ w64.T
            rel_x = np.linalg.norm(y - exact) / np.linalg.norm(exact)
            assert rel_x <= 1.5e-2, _why(qtype.name, n, k, f"M={m}", f"||y - W x|| / ||W x|| = {rel_x:.3g}")


def test_emulation_rejects_a_type_without_kernel(lib):
    w = np.zeros((8, 20), dtype=np.uint8)
    xq, xds = np.zeros((9, 32), dtype=np.int8), np.zeros((9, 1, 2), dtype=np.float32)
    y = np.empty((9, 8), dtype=np.float32)
    assert lib.mmq_emulate(int(GGMLType.Q4_1), _ptr(w), 8, 32, _ptr(xq), _ptr(xds), 9, _ptr(y)) == -1


class _Kernels:
    """The few cuda_* entry points CudaBackend.linear calls, recording which path each call took."""

    def __init__(self, mmq_types=(68, 69, 70, 71)):
        self.calls: list[str] = []
        self.mmq_types = set(mmq_types)
        self.mmq_asked: list[tuple[int, int]] = []  # (type id, device index) per cuda_mmq_supported call

    def cuda_gemv_supported(self, qt):
        return True

    cuda_dequant_supported = cuda_gemv_supported

    def cuda_gemv(self, w, qt, x):
        self.calls.append("gemv")
        return torch.zeros(x.shape[0], w.shape[0])

    def cuda_mmq_supported(self, qt, device):
        self.mmq_asked.append((qt, device))
        return qt in self.mmq_types

    def cuda_quantize_act(self, x):
        assert x.dtype == torch.float32 and x.is_contiguous()
        return torch.zeros(x.shape, dtype=torch.int8), torch.zeros(x.shape[0], x.shape[1] // 32, 2)

    def cuda_mmq(self, w, qt, xq, xds):
        self.calls.append("mmq")
        return torch.zeros(xq.shape[0], w.shape[0])

    def cuda_dequantize(self, w, qt, k, ids, half, check_ids=True):
        self.calls.append("cublas")
        return torch.zeros(w.shape[0], k, dtype=torch.float16 if half else torch.float32)


def test_prompt_chunks_of_tiled_weights_take_mmq(monkeypatch):
    """CudaBackend.linear: above GEMV_MAX_M rows a tiled weight goes to cuda_mmq (asked once per type, with the
    backend's device); PYLLM_CUDA_MMQ=0, a weight in GGUF order, or a type the device's kernel does not take go to
    dequantize + cuBLAS; up to GEMV_MAX_M rows the GEMV."""
    from pyllm.backends import cuda as cb
    from pyllm.ops import GEMV_MAX_M

    monkeypatch.delenv("PYLLM_CUDA_MMQ", raising=False)
    n, k = 16, 256
    tiled = cb.CudaTiledTensor(70, GGMLType.Q4_K, (n, k), torch.zeros(n, 144, dtype=torch.uint8), "w")
    gguf = QTensor(GGMLType.Q4_K, (n, k), torch.zeros(n, 144, dtype=torch.uint8), "w")
    chunk, decode = torch.randn(GEMV_MAX_M + 1, k), torch.randn(GEMV_MAX_M, k)

    kern = _Kernels()
    b = cb.CudaBackend(kern, torch.device("cpu"))
    for x, w in ((chunk, tiled), (chunk, tiled), (decode, tiled), (chunk, gguf)):
        assert b.linear(x, w).shape == (x.shape[0], n)
    assert kern.calls == ["mmq", "mmq", "gemv", "cublas"]
    assert kern.mmq_asked == [(70, 0), (12, 0)]  # each type once (then remembered), with the backend's device

    monkeypatch.setenv("PYLLM_CUDA_MMQ", "0")
    kern.calls.clear()
    b.linear(chunk, tiled)
    assert kern.calls == ["cublas"]

    monkeypatch.delenv("PYLLM_CUDA_MMQ")
    old_gpu = _Kernels(mmq_types=())  # compute capability below 8.0: the kernel takes no type there
    cb.CudaBackend(old_gpu, torch.device("cpu")).linear(chunk, tiled)
    assert old_gpu.calls == ["cublas"]
    no_kernel = types.SimpleNamespace(**{a: getattr(kern, a) for a in ("cuda_gemv_supported", "cuda_dequant_supported",
                                                                        "cuda_dequantize")})
    kern.calls.clear()
    cb.CudaBackend(no_kernel, torch.device("cpu")).linear(chunk, tiled)  # an extension built before MMQ
    assert kern.calls == ["cublas"]


def test_mmq_takes_the_gguf_tiled_types_only(lib):
    """mmq::mmq_type (cuda_mmq_supported's and the kernel's test): Q4_0 / Q8_0 / Q4_K / Q6_K tiled, not their GGUF
    rows, not AWQ rows or AWQ's tiled layout (the kernel has no AWQ unpack)."""
    for qt in (68, 69, 70, 71):
        assert lib.mmq_takes(qt) == 1, qt
    awq_rows = [lib.awq_qtype(g) for g in (32, 64, 128, 256)]
    awq_tiled = [lib.tiled_qtype(qt) for qt in awq_rows]
    assert sorted(awq_tiled) == [72, 73, 74, 75]
    for qt in [int(t) for t in TYPES] + awq_rows + awq_tiled:
        assert lib.mmq_takes(qt) == 0, qt


def test_prompt_chunks_of_tiled_awq_dequantize(lib, monkeypatch):
    """CudaBackend.linear on a tiled AWQ weight: decode rows through the GEMV, prompt chunks through dequantize +
    cuBLAS (the device kernel's answer stood in for by mmq::mmq_type)."""
    from pyllm.backends import cuda as cb
    from pyllm.ops import GEMV_MAX_M

    monkeypatch.delenv("PYLLM_CUDA_MMQ", raising=False)
    n, k = 16, 256
    tid = lib.tiled_qtype(lib.awq_qtype(128))
    w = cb.CudaTiledTensor(tid, lib.awq_qtype(128), (n, k), torch.zeros(n, 134, dtype=torch.uint8), "w")
    kern = _Kernels(mmq_types=[qt for qt in range(80) if lib.mmq_takes(qt)])
    b = cb.CudaBackend(kern, torch.device("cpu"))
    for x in (torch.randn(GEMV_MAX_M + 1, k), torch.randn(GEMV_MAX_M, k), torch.randn(70, k)):
        assert b.linear(x, w).shape == (x.shape[0], n)
    assert kern.calls == ["cublas", "gemv", "cublas"]
    assert kern.mmq_asked == [(tid, 0)]
