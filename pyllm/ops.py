"""Typed wrappers over the kernels, with torch reference fallbacks.

    qmatmul(x [M, K] f32, w QTensor [N, K]) -> [M, N] f32     y = x @ W.T
    dequantize(w QTensor [N, K]) -> [N, K] f32
    embedding(w QTensor [N, K], ids [T] int) -> [T, K] f32   rows of W

M <= 8 (decode) runs the fused dequantize-in-GEMV (W read once, quantized); larger M (prefill) dequantizes
W a tile at a time and multiplies with torch's GEMM.  Types the extension lacks (and every call when the
extension cannot be built) take the reference path: ``QTensor.dequantize()`` + a float32 matmul.

Decode calls qmatmul ~200 times per token, so the fast path is one branch and one extension call: the
binding validates every tensor (raising ValueError/TypeError with the values), Python re-checks nothing.
"""

from __future__ import annotations

import sys

import torch

from . import _ext
from .errors import PyllmError

GEMV_MAX_M = 8  # = pyllm::GEMV_MAX_M (csrc/kernels.h)

_fast = True      # set_backend("fast" | "reference")
_C = None         # the extension module; False once it failed to load (then everything takes the reference)
_threads = None   # requested before the extension was loaded


def _load():
    global _C
    if _C is None:
        try:
            _C = _ext.load()
            if _threads:
                _C.set_num_threads(_threads)
        except PyllmError as e:
            print(f"{e}\npyllm: falling back to the (slow) torch reference kernels", file=sys.stderr)
            _C = False
    return _C


def _reference_matmul(x: torch.Tensor, w, out):
    y = x @ w.dequantize(torch.float32).T
    if out is None:
        return y
    out.copy_(y)
    return out


def qmatmul(x: torch.Tensor, w, out: torch.Tensor | None = None) -> torch.Tensor:
    """x f32 [M, K] (or [..., K]) @ W.T -> f32 [M, N] (or [..., N]).  ``out``: optional f32 [M, N] to fill."""
    C = _C if _C else _load()
    if x.dim() != 2:
        y = qmatmul(x.reshape(-1, x.shape[-1]), w)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    if _fast and C:
        try:
            if x.shape[0] <= GEMV_MAX_M:
                return C.gemv(x, w.data, w.qtype, out)
            return C.gemm(x, w.data, w.qtype, out)
        except NotImplementedError:  # a GGML type the kernels lack
            pass
    return _reference_matmul(x, w, out)


def dequantize(w) -> torch.Tensor:
    """W as f32 with W's shape ([N, K], or [K] for a vector); bit-identical to gguf.quants.dequantize."""
    C = _C if _C else _load()
    if _fast and C:
        try:
            data = w.data if w.data.dim() == 2 else w.data.reshape(-1, w.data.shape[-1])
            return C.dequantize(data, w.qtype).reshape(w.shape)
        except NotImplementedError:
            pass
    return w.dequantize(torch.float32)


def embedding(w, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64/int32, any shape, e.g. [T]) of W [N, K] as f32 [*ids.shape, K]; only those rows are
    dequantized."""
    C = _C if _C else _load()
    if _fast and C:
        try:
            return C.dequantize(w.data, w.qtype, ids.reshape(-1)).reshape(*ids.shape, w.shape[-1])
        except NotImplementedError:
            pass
    return w.rows(ids).float()


def set_backend(name: str) -> None:
    """"fast": the extension's kernels; "reference": QTensor.dequantize() + float32 matmul (tests)."""
    global _fast
    if name not in ("fast", "reference"):
        raise PyllmError(f"backend must be 'fast' or 'reference', got {name!r}")
    _fast = name == "fast"


def get_backend() -> str:
    return "fast" if _fast else "reference"


def set_num_threads(n: int) -> None:
    """Threads for pyllm's CPU kernels (default: physical cores).  torch's own setting is left alone."""
    global _threads
    n = int(n)
    if n < 1:
        raise PyllmError(f"number of threads must be >= 1, got {n}")
    _threads = n
    if _C:
        _C.set_num_threads(n)


def get_num_threads() -> int:
    C = _C if _C else _load()
    return C.get_num_threads() if C else torch.get_num_threads()


def set_isa(name: str) -> None:
    """CPU kernel family: "avx2" (default where the CPU has it) or "scalar" (the _generic reference kernels)."""
    C = _C if _C else _load()
    if not C:
        raise PyllmError("pyllm: the C++ extension is not available")
    C.set_isa(name)
