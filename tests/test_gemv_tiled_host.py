"""The CUDA decode GEMV's tiled weight layout (csrc/common/gemv_tiled.h), on the host: the same header functions the
upload and the kernel call, built with g++ into a small library (tests/gemv_tiled_host.cpp) and called via ctypes.

- relayout: tiling moves every byte (the tiled bytes differ from the GGUF rows) and the inverse gives back the GGUF
  rows byte for byte; AWQ rows likewise, and their tiles hold each byte where the layout's definition (gemv_tiled.h,
  restated here in numpy) puts it, every 16-byte code plane 16-byte aligned in the matrix (odd K / G included);
- the tiled dequantizer (the CUDA prefill path's, and embedding rows') equals pyllm's GGUF dequantizer, itself
  tied to gguf.quants (tests/test_quant.py), bit for bit; for AWQ, the exact (q - z) * s of the rows'
  definition and the extension's CPU AWQ dequantizer, bit for bit;
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
from gpu.cuda_testutil import random_awq_rows, random_blocks

ROOT = Path(__file__).resolve().parent.parent
SEED = int(os.environ.get("PYLLM_TEST_SEED") or time.time_ns() % 2**31)
TYPES = [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K]
# (N, K): whole groups of 32 units, a last group of fewer lanes (K = 576: 18 Q4_0 units; K = 768: 12 Q4_K units),
# and the 8B's K = 14336 (14 Q4_0 groups, 7 Q4_K groups)
SHAPES = [(8, 256), (16, 576), (8, 768), (24, 4096), (8, 14336)]
# AWQ (G, N, K): every group size; K / G odd with an odd tile (G 64: 21 groups, G 128: 7 (Qwen2.5-0.5B's 896),
# G 256: 5); a last group of fewer lanes (K = 576, 1344, 896); the 8B's K = 4096 and 14336 at G 128
AWQ_CASES = [(32, 16, 576), (64, 24, 1344), (128, 24, 896), (128, 16, 4096), (128, 16, 14336), (256, 16, 1280)]


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
    L.mmq_takes.argtypes = [ctypes.c_int]
    L.awq_qtype.argtypes = [ctypes.c_int]
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
        return torch.from_numpy(relayout(self.lib, int(qtype), np.ascontiguousarray(w.numpy()), k))


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


def _awq_id(lib, g: int) -> int:
    qt = lib.awq_qtype(g)
    assert qt >= 0, g
    return qt


def awq_tiles_reference(rows: np.ndarray, k: int, g: int) -> np.ndarray:
    """AWQ rows [N, 3k/g + k/2] -> the tiled layout as csrc/common/gemv_tiled.h defines it, restated: per tile of 8
    rows, the codes region (unit u of row r at group u // 32's 8 x L x 16 bytes, L its lanes, row r's at (r L + u % 32)
    * 16) and the meta region (scales [row][group] fp16, then zeros [row][group]); an odd tile puts its meta first."""
    n, rb = rows.shape
    ng, nu = k // g, k // 32
    out = np.empty_like(rows)
    for t in range(n // 8):
        tile = out[8 * t:8 * t + 8].reshape(-1)
        codes0, meta0 = (24 * ng, 0) if t % 2 else (0, 4 * k)
        for r in range(8):
            row = rows[8 * t + r]
            for u in range(nu):
                grp, lane = divmod(u, 32)
                lanes = min(32, nu - 32 * grp)
                off = codes0 + grp * 8 * 512 + (r * lanes + lane) * 16
                assert (8 * t * rb + off) % 16 == 0, (t, r, u, "a code plane not 16-byte aligned in the matrix")
                tile[off:off + 16] = row[3 * ng + 16 * u:3 * ng + 16 * u + 16]
            tile[meta0 + 2 * ng * r:meta0 + 2 * ng * (r + 1)] = row[:2 * ng]
            tile[meta0 + 16 * ng + ng * r:meta0 + 16 * ng + ng * (r + 1)] = row[2 * ng:3 * ng]
    return out


@pytest.mark.parametrize("g,n,k", AWQ_CASES)
def test_awq_relayout_round_trip(lib, g, n, k):
    rows, _ = random_awq_rows(n, k, g, _rng("awq rt", g, n, k))
    qt = _awq_id(lib, g)
    assert lib.tiled_tileable(qt, n, k) == 1 and lib.tiled_tileable(qt, n - 4, k) == 0
    tiled = relayout(lib, qt, rows, k)
    assert tiled.shape == rows.shape and not np.array_equal(tiled, rows), _why("AWQ", g, n, k)
    assert np.array_equal(np.sort(tiled, axis=None), np.sort(rows, axis=None)), \
        _why("AWQ", g, n, k, "tiling is not a permutation of the bytes")
    if k <= 1344:  # the numpy restatement is slow for long rows
        assert np.array_equal(tiled, awq_tiles_reference(rows, k, g)), \
            _why("AWQ", g, n, k, "the tiles differ from the layout's definition")
    back = relayout(lib, qt, tiled, k, inverse=True)
    assert np.array_equal(back, rows), _why("AWQ", g, n, k, "untile(tile(w)) != w")


@pytest.mark.parametrize("g,n,k", AWQ_CASES)
def test_awq_tiled_dequantize_equals_rows(lib, g, n, k):
    from pyllm import _ext

    rows, w64 = random_awq_rows(n, k, g, _rng("awq dq", g, n, k))
    qt = _awq_id(lib, g)
    got = np.empty((n, k), dtype=np.float32)
    assert lib.tiled_dequantize(qt, _ptr(relayout(lib, qt, rows, k)), n, k, _ptr(got)) == 0
    want = w64.astype(np.float32)
    assert np.array_equal(want.astype(np.float64), w64)  # (q - z) * s is exact in float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), _why("AWQ", g, n, k)
    cpu = _ext.load().dequantize(torch.from_numpy(rows), qt).numpy()  # pyllm's AWQRows.dequantize
    assert np.array_equal(got.view(np.uint32), cpu.view(np.uint32)), _why("AWQ", g, n, k, "vs the CPU dequantizer")


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("g,n,k", AWQ_CASES)
def test_awq_kernel_arithmetic_matches_float64(lib, g, n, k, split):
    """As test_kernel_arithmetic_matches_float64, for the AWQ tiles: the same bounds on the same kind of inputs."""
    rng = _rng("awq gemv", g, n, k, split)
    rows, w64 = random_awq_rows(n, k, g, rng)
    qt = _awq_id(lib, g)
    tiled = relayout(lib, qt, rows, k)
    m = 3
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, size=(m, 1))).astype(np.float32)
    xq, xds = quantize_act(x)
    y = emulate(lib, qt, tiled, k, xq, xds, split)
    xdeq = (xq.astype(np.float64).reshape(m, k // 32, 32) * xds[..., :1].astype(np.float64)).reshape(m, k)
    ref = xdeq @ w64.T
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel <= 2e-5, _why("AWQ", g, n, k, f"split {split}", f"||y - ref|| / ||ref|| = {rel:.3g}")
    worst = np.max(np.abs(y - ref) / (np.abs(xdeq) @ np.abs(w64).T + 1e-30))
    assert worst <= 1e-5, _why("AWQ", g, n, k, f"split {split}", f"worst per-output error {worst:.3g}")


def test_upload_tiles_awq_rows(lib, monkeypatch):
    """_to_device: AWQ rows (AWQRows, or an AutoAWQ tensor repacked to them) that a GEMV reads go up tiled (the AWQ
    tiled id, the relayout's bytes, the rows' size) where the rows are whole tiles; else, an embedding table, or under
    PYLLM_CUDA_TILED=0, as AWQ rows (CudaAwqRows)."""
    from pyllm import _ext
    from pyllm.backends import cuda as cb
    from pyllm.formats.awq.repack import AWQRows
    from pyllm.formats.awq.unpack import AWQTensor
    from test_awq import random_awq

    ext = _ext.load()

    class Entry(_TilingEntryPoints):  # plus the extension's AWQ repacker, for AutoAWQ tensors
        awq_qtype, awq_repack = staticmethod(ext.awq_qtype), staticmethod(ext.awq_repack)

    C, cpu = Entry(lib), torch.device("cpu")

    def awq(g, n, k):
        rows, _ = random_awq_rows(n, k, g, _rng("awq up", g, n, k))
        return AWQRows(torch.from_numpy(rows), _awq_id(lib, g), (n, k), g, "w")

    for g in (32, 64, 128, 256):
        w = awq(g, 16, 1280 if g == 256 else 896)
        up = cb._to_device(w, cpu, C, gemv=True)
        tid = 72 + [32, 64, 128, 256].index(g)  # AWQ_G<g>_TILED
        assert isinstance(up, cb.CudaTiledTensor) and up.qtype == tid and up.base == w.qtype, g
        assert up.shape == w.shape and up.nbytes == w.nbytes
        assert np.array_equal(up.data.numpy(), relayout(lib, w.qtype, w.data.numpy(), w.shape[1]))
        assert isinstance(cb._to_device(w, cpu, C), cb.CudaAwqRows)  # not a GEMV operand
    _, _, s, qw, qz = random_awq(512, 64, 128, seed=5)  # AutoAWQ tensors: repacked, then tiled
    up = cb._to_device(AWQTensor(qw, qz, s, 128, name="w"), cpu, C, gemv=True)
    assert isinstance(up, cb.CudaTiledTensor) and up.shape == (64, 512)
    want = relayout(lib, up.base, ext.awq_repack(qw, qz, s, 128).numpy(), 512)
    assert np.array_equal(up.data.numpy(), want)
    assert isinstance(cb._to_device(awq(128, 12, 896), cpu, C, gemv=True), cb.CudaAwqRows)  # rows not whole tiles
    monkeypatch.setenv("PYLLM_CUDA_TILED", "0")
    assert isinstance(cb._to_device(awq(128, 16, 896), cpu, C, gemv=True), cb.CudaAwqRows)
