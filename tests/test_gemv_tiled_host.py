"""The CUDA decode GEMV's tiled weight layout (csrc/common/gemv_tiled.h), on the host: the same header functions the
upload and the kernel call, built with g++ into a small library (tests/gemv_tiled_host.cpp) and called via ctypes.

- relayout: tiling moves every byte (the tiled bytes differ from the GGUF rows) and the inverse gives back the GGUF
  rows byte for byte;
- the tiled dequantizer (the CUDA prefill path's, and embedding rows') equals pyllm's GGUF dequantizer, itself
  tied to gguf.quants (tests/test_quant.py), bit for bit;
- the kernel's arithmetic, emulated lane by lane in the kernel's order (csrc/cuda/gemv_tiled.cu), against float64 on
  the dequantized weights with the same int8 activation codes: ||y - ref|| / ||ref|| <= 2e-5 (fp32 accumulation
  over K <= 14336 errs by ~1e-7 relative; an indexing error moves whole units, orders of magnitude more).
Inputs are fresh each run (PYLLM_TEST_SEED replays one; each failure prints it).  A missing g++ or a missing entry
point fails: this is the only check of the layout on a machine without a GPU.
"""

import ctypes
import os
import shutil
import subprocess
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from pyllm.formats.gguf import BLOCK_INFO, GGMLType
from pyllm.formats.quant import dequantize_blocks
from gpu.cuda_testutil import random_blocks

ROOT = Path(__file__).resolve().parent.parent
SEED = int(os.environ.get("PYLLM_TEST_SEED") or time.time_ns() % 2**31)
TYPES = [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K]
# (N, K): whole groups of 32 units, a last group of fewer lanes (K = 576: 18 Q4_0 units; K = 768: 12 Q4_K units),
# and the 8B's K = 14336 (14 Q4_0 groups, 7 Q4_K groups)
SHAPES = [(8, 256), (16, 576), (8, 768), (24, 4096), (8, 14336)]


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


def _why(*what) -> str:
    return f"(PYLLM_TEST_SEED={SEED}; {', '.join(map(str, what))})"


def _shapes(qtype):
    bs = BLOCK_INFO[qtype][0]
    return [(n, k) for n, k in SHAPES if k % bs == 0]


def build_host_lib(directory: Path) -> ctypes.CDLL:
    """tests/gemv_tiled_host.cpp built with g++ into ``directory`` and loaded (also used by tests/test_mmq_host.py and
    tests/gpu)."""
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    assert cxx, "no C++ compiler (g++) to build the tiled layout's host library"
    so = directory / "gemv_tiled_host.so"
    r = subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-ffp-contract=off", "-Wall", "-Wextra",
                        "-Werror", f"-I{ROOT / 'csrc'}", str(ROOT / "tests/gemv_tiled_host.cpp"), "-o", str(so)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    L = ctypes.CDLL(str(so))
    p = ctypes.c_void_p
    L.tiled_relayout.argtypes = [ctypes.c_int, ctypes.c_int, p, p, ctypes.c_int64, ctypes.c_int]
    L.tiled_dequantize.argtypes = [ctypes.c_int, p, ctypes.c_int64, ctypes.c_int, p]
    L.tiled_emulate.argtypes = [ctypes.c_int, p, ctypes.c_int64, ctypes.c_int, p, p, ctypes.c_int, ctypes.c_int, p]
    L.tiled_tileable.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    L.mmq_emulate.argtypes = [ctypes.c_int, p, ctypes.c_int64, ctypes.c_int, p, p, ctypes.c_int, p]
    L.mmq_stage_row.argtypes = [ctypes.c_int, p, ctypes.c_int, ctypes.c_int64, p, p]
    return L


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_host_lib(tmp_path_factory.mktemp("gemv_tiled"))


def _ptr(a: np.ndarray):
    assert a.flags.c_contiguous
    return a.ctypes.data_as(ctypes.c_void_p)


def emulate(lib, qtype, tiled: np.ndarray, k: int, xq: np.ndarray, xds: np.ndarray, split: int) -> np.ndarray:
    """The kernel's y [M, N] for tiled weights and activation codes (xq int8 [M, K], xds float32 [M, K/32, 2])."""
    m, n = xq.shape[0], tiled.shape[0]
    xq, xds = np.ascontiguousarray(xq), np.ascontiguousarray(xds, dtype=np.float32)
    y = np.empty((m, n), dtype=np.float32)
    assert lib.tiled_emulate(int(qtype), _ptr(tiled), n, k, _ptr(xq), _ptr(xds), m, split, _ptr(y)) == 0
    return y


def relayout(lib, qtype, blocks: np.ndarray, k: int, inverse: bool = False) -> np.ndarray:
    out = np.empty_like(blocks)
    assert lib.tiled_relayout(int(qtype), int(inverse), _ptr(blocks), _ptr(out), blocks.shape[0], k) == 0
    return out


def quantize_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] float32 -> (int8 codes, float32 [M, K/32, 2] (d, d * sum)) as csrc/cuda/gemv.cu quantize_act makes
    them: d = max|x| / 127 per 32 values, codes round-half-even(x / d)."""
    m, k = x.shape
    b = x.reshape(m, k // 32, 32)
    d = (np.abs(b).max(-1) / np.float32(127)).astype(np.float32)
    q = np.rint(b / np.where(d > 0, d, 1)[..., None]).astype(np.int8)
    ds = np.stack([d, d * q.astype(np.int32).sum(-1).astype(np.float32)], -1).astype(np.float32)
    return q.reshape(m, k), np.ascontiguousarray(ds)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_relayout_round_trip(lib, qtype):
    for n, k in _shapes(qtype):
        blocks = np.ascontiguousarray(random_blocks(qtype, n, k, _rng("rt", qtype, n, k)))
        tiled = relayout(lib, qtype, blocks, k)
        assert tiled.shape == blocks.shape
        assert not np.array_equal(tiled, blocks), _why(qtype.name, n, k, "tiling left the bytes in place")
        assert np.array_equal(np.sort(tiled, axis=None), np.sort(blocks, axis=None)) or qtype == GGMLType.Q6_K, \
            _why(qtype.name, n, k, "tiling is not a permutation of the bytes")
        back = relayout(lib, qtype, tiled, k, inverse=True)
        assert np.array_equal(back, blocks), _why(qtype.name, n, k, "untile(tile(w)) != w")


def test_relayout_rejects_a_type_without_layout(lib):
    blocks = np.zeros((8, 20), dtype=np.uint8)
    out = np.empty_like(blocks)
    assert lib.tiled_relayout(int(GGMLType.Q4_1), 0, _ptr(blocks), _ptr(out), 8, 32) == -1


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_tiled_dequantize_equals_gguf(lib, qtype):
    for n, k in _shapes(qtype):
        blocks = np.ascontiguousarray(random_blocks(qtype, n, k, _rng("dq", qtype, n, k)))
        tiled = relayout(lib, qtype, blocks, k)
        got = np.empty((n, k), dtype=np.float32)
        assert lib.tiled_dequantize(int(qtype), _ptr(tiled), n, k, _ptr(got)) == 0
        want = dequantize_blocks(qtype, torch.from_numpy(blocks)).reshape(n, k).numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), _why(qtype.name, n, k)


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_arithmetic_matches_float64(lib, qtype, split):
    for n, k in _shapes(qtype):
        rng = _rng("gemv", qtype, n, k, split)
        blocks = np.ascontiguousarray(random_blocks(qtype, n, k, rng))
        w64 = dequantize_blocks(qtype, torch.from_numpy(blocks)).reshape(n, k).double().numpy()
        tiled = relayout(lib, qtype, blocks, k)
        m = 3
        x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, size=(m, 1))).astype(np.float32)
        xq, xds = quantize_act(x)
        y = emulate(lib, qtype, tiled, k, xq, xds, split)
        xdeq = (xq.astype(np.float64).reshape(m, k // 32, 32) * xds[..., :1].astype(np.float64)).reshape(m, k)
        ref = xdeq @ w64.T
        rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
        assert rel <= 2e-5, _why(qtype.name, n, k, f"split {split}", f"||y - ref|| / ||ref|| = {rel:.3g}")
        # and per output, relative to the size of its terms: no row or unit is dropped or doubled
        worst = np.max(np.abs(y - ref) / (np.abs(xdeq) @ np.abs(w64).T + 1e-30))
        assert worst <= 1e-5, _why(qtype.name, n, k, f"split {split}", f"worst per-output error {worst:.3g}")


class _TilingEntryPoints:
    """The extension's tiling entry points (csrc/cuda/bindings_cuda.cpp: cuda_tiled_qtype, cuda_tileable,
    cuda_tile_weight), over the same header functions, for the upload code on a host without the CUDA build."""

    def __init__(self, lib):
        self.lib = lib

    def cuda_tiled_qtype(self, qtype):
        return self.lib.tiled_qtype(int(qtype))

    def cuda_tileable(self, qtype, n, k):
        return bool(self.lib.tiled_tileable(int(qtype), n, k))

    def cuda_tile_weight(self, w, qtype, k):
        assert w.device.type == "cpu"
        return torch.from_numpy(relayout(self.lib, GGMLType(qtype), np.ascontiguousarray(w.numpy()), k))


def test_upload_tiles_the_gemv_matrices(lib, monkeypatch):
    """pyllm/backends/cuda.py _to_device: a matrix a GEMV reads goes up tiled where its type and shape have the layout
    (the tiled id, the relayout's bytes, the file's size); anything else, or everything under PYLLM_CUDA_TILED=0, as
    GGUF rows."""
    from pyllm.backends import cuda as cb
    from pyllm.formats.quant import QTensor

    C, cpu = _TilingEntryPoints(lib), torch.device("cpu")

    def weight(qtype, n, k):
        return QTensor(qtype, (n, k), torch.from_numpy(random_blocks(qtype, n, k, _rng("up", qtype, n, k))), "w")

    for qtype, tid in ((GGMLType.Q4_0, 68), (GGMLType.Q8_0, 69), (GGMLType.Q4_K, 70), (GGMLType.Q6_K, 71)):
        w = weight(qtype, 16, 512)
        up = cb._to_device(w, cpu, C, gemv=True)
        assert isinstance(up, cb.CudaTiledTensor) and up.qtype == tid and up.base == qtype, qtype.name
        assert up.shape == w.shape and up.nbytes == w.nbytes
        assert np.array_equal(up.data.numpy(), relayout(lib, qtype, w.data.numpy(), 512))
        assert isinstance(cb._to_device(w, cpu, C), QTensor)  # not a GEMV operand (an embedding table)
    for w in (weight(GGMLType.Q4_K, 12, 512), weight(GGMLType.Q4_1, 16, 512)):  # rows not whole tiles; no layout
        assert isinstance(cb._to_device(w, cpu, C, gemv=True), QTensor)
    monkeypatch.setenv("PYLLM_CUDA_TILED", "0")
    assert isinstance(cb._to_device(weight(GGMLType.Q4_K, 16, 512), cpu, C, gemv=True), QTensor)
