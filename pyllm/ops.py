"""Typed wrappers over the kernels, with torch reference fallbacks.

    qmatmul(x [M, K] f32, w QTensor [N, K]) -> [M, N] f32     y = x @ W.T   (x may be [..., K])
    dequantize(w QTensor [N, K]) -> [N, K] f32
    embedding(w QTensor [N, K], ids int [T]) -> [T, K] f32   rows of W

M <= 8 (decode) runs the fused dequantize-in-GEMV (W read once, quantized); up to 32 rows it runs on 8-row
chunks (int8 dot products beat dequantizing W); larger M (prefill) dequantizes W a tile at a time and
multiplies with torch's fp32 GEMM.  The choice is made in C++ (bindings_kernels.cpp mul_mat).  Types
the extension lacks, and every call when the extension cannot be built, take the reference path:
``QTensor.dequantize()`` + a float32 matmul.  Which functions a model calls is its backend's business
(pyllm/backends): nothing here is a process-wide switch.

Decode calls qmatmul ~200 times per token, so the fast path is one attribute lookup and one extension call
(~2 us with `out`, ~4 us allocating): the binding validates every tensor (raising ValueError/TypeError with the
values) and Python re-checks nothing.  The extension is built/loaded on the first call, not at import.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from . import _ext
from .errors import PyllmError

GEMV_MAX_M = _ext.limit("GEMV_MAX_M")  # the most rows of x one fused GEMV pass takes (csrc/common/limits.h)


class _LazyExtension:
    """Stands in for the extension module until first use; then ``_C`` is the module itself.  If it cannot be
    built, every kernel lookup raises NotImplementedError, which the wrappers below turn into the reference."""

    failed: PyllmError | None = None

    def __getattr__(self, name):
        global _C
        if self.failed is None:
            try:
                mod = _ext.load()
            except (_ext.IsaError, _ext.CacheError):  # PYLLM_ISA asked for kernels this machine lacks, or the
                raise                                   # cache is unusable: errors the user can fix, not a fallback
            except PyllmError as e:
                print(f"{e}\npyllm: falling back to the (slow) torch reference kernels", file=sys.stderr)
                self.failed = e
            else:
                if _threads:
                    mod.set_num_threads(_threads)
                _C = mod
                return getattr(mod, name)
        raise NotImplementedError(f"pyllm extension unavailable: {self.failed}")


_C = _LazyExtension()
_threads = None   # set_num_threads() before the extension was loaded


def _reference_matmul(x: torch.Tensor, w, out):
    y = x @ w.dequantize(torch.float32).T
    if out is None:
        return y
    out.copy_(y)
    return out


def qmatmul(x: torch.Tensor, w, out: torch.Tensor | None = None, precise_x: bool = False) -> torch.Tensor:
    """x f32 [..., K] @ W.T -> f32 [..., N].  ``out``: optional f32 [..., N] to fill (and return).  ``precise_x``:
    16-bit activations where the weight type has such a GEMV (see qmatmul_output)."""
    try:
        return _C.mul_mat(x, w.data, w.qtype, out, precise_x)
    except NotImplementedError:  # a GGML type the kernels lack, or no extension
        return _reference_matmul(x, w, out)


def qmatmul_output(x: torch.Tensor, w, out: torch.Tensor | None = None) -> torch.Tensor:
    """qmatmul for the output projection: its error goes straight into the logits, so the GEMV keeps the
    activations at 16 bits where the weight type has such a kernel (Q8_0, what small models' tied embeddings
    use; see Q16Row in csrc/cpu/cpu_impl.h).  Other types, and prefill's GEMM, are the same as qmatmul."""
    return qmatmul(x, w, out, precise_x=True)


def qmatmul_experts(x: torch.Tensor, ws: list, ids: torch.Tensor) -> list[torch.Tensor] | None:
    """Mixture-of-experts matmuls over stacked expert tensors ws ([E, N_i, K] QTensors): y_i [T, k, N_i] with
    y_i[t, j] = W_i[ids[t, j]] @ x[t] (x f32 [T, K]: a token's row shared by its k experts) or @ x[t, j] (x [T, k,
    K]).  Decode reads only the selected experts' rows in one pass, prefill each used expert's rows once
    (bindings_kernels.cpp moe_mul_mat).  None where the kernels cannot take them (no extension, a type they lack,
    tensors off the CPU): the model's grouped torch form runs then."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or any(w.data.device.type != "cpu" for w in ws):
        return None
    try:
        return _C.moe_mul_mat(x.contiguous(), [w.data for w in ws], [int(w.qtype) for w in ws],
                              ids.to(torch.int64).contiguous())
    except NotImplementedError:
        return None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int = 0) -> torch.Tensor | None:
    """Causal attention of T new positions over S >= T keys, the last T of them theirs, float32: q [T, H, hd], k/v
    [S, Hkv, hd] (any strides but the last) -> [T, H*hd] (window > 0: each position sees its last ``window`` keys).
    None where the kernel cannot take them (no extension, tensors not float32 on the CPU): the caller's torch
    attention runs then."""
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, k, v)):
        return None
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    try:
        return _C.causal_attention(q, k, v, scale, window)
    except NotImplementedError:
        return None


def _cpu_f32(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in ts)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x * rsqrt(mean(x^2, -1) + eps) * w for x f32 [..., D], w [D]; None where the kernel cannot take them."""
    if not _cpu_f32(x, w):
        return None
    try:
        return _C.rms_norm(x, w, eps)
    except NotImplementedError:
        return None


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, neox: bool) -> torch.Tensor | None:
    """x [T, H, hd] f32 rotated in place by cos/sin [T, rope_dim/2] and returned; None (x untouched) where the
    kernel cannot take them."""
    if x.dim() != 3 or not _cpu_f32(x, cos, sin):
        return None
    try:
        return _C.rope_(x, cos, sin, rope_dim, neox)
    except NotImplementedError:
        return None


def glu_(g: torch.Tensor, u: torch.Tensor, gelu_tanh: bool) -> torch.Tensor | None:
    """g = act(g) * u in place and returned (act SiLU, or the tanh-approximated GELU); None (g untouched) where the
    kernel cannot take them."""
    if g.shape != u.shape or not _cpu_f32(g, u):
        return None
    try:
        return _C.glu_(g, u, gelu_tanh)
    except NotImplementedError:
        return None


def top_k_ids(f: np.ndarray, k: int) -> np.ndarray | None:
    """Ids of the k largest of a float32 vector, ascending (lowest ids where values tie at the k-th), from one
    vectorized scan (~40 us for 262k values against ~1.8 ms for numpy's partition); None where the kernel cannot
    take it (no extension, not float32, a NaN or an infinity): the caller's numpy path then decides."""
    if f.dtype != np.float32 or f.ndim != 1 or not 0 < k <= len(f):
        return None
    try:
        ids = _C.top_k_ids(torch.from_numpy(np.ascontiguousarray(f)), k)
    except NotImplementedError:
        return None
    return None if ids is None else ids.numpy()


def dequantize(w) -> torch.Tensor:
    """W as f32 with W's shape ([N, K], or [K] for a vector); bit-identical to gguf.quants.dequantize."""
    try:
        data = w.data if w.data.dim() == 2 else w.data.reshape(-1, w.data.shape[-1])
        return _C.dequantize(data, w.qtype).reshape(w.shape)
    except NotImplementedError:
        return w.dequantize(torch.float32)


def embedding(w, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64/int32, any shape, e.g. [T]) of W [N, K] as f32 [*ids.shape, K]; only those rows are
    dequantized."""
    try:
        return _C.dequantize(w.data, w.qtype, ids.reshape(-1)).reshape(*ids.shape, w.shape[-1])
    except NotImplementedError:
        return w.rows(ids).float()


def set_num_threads(n: int) -> None:
    """Threads for pyllm's CPU kernels (default: physical cores).  torch's own setting is left alone."""
    global _threads
    n = int(n)
    if n < 1:
        raise PyllmError(f"number of threads must be >= 1, got {n}")
    _threads = n
    if not isinstance(_C, _LazyExtension):
        _C.set_num_threads(n)


def release_thread_pool() -> None:
    """The calling thread's OpenMP workers exit (the extension's and torch's: one runtime).  For a thread that is done
    with the kernels while another runs them: libgomp throttles every thread's spin-waits once its pools' threads
    outnumber the cores, and a decode step then sleeps and wakes its workers ~200 times (csrc/kernels.h
    cpu_release_thread_pool).  Costs the next parallel region of this thread its workers' start (~0.1 ms).  A no-op
    before the extension is loaded (no kernel has run) and where it could not be built."""
    if not isinstance(_C, _LazyExtension):
        _C.release_thread_pool()


def advise_huge_pages(t: torch.Tensor) -> int:
    """Asks for huge pages under the CPU tensor ``t`` before anything is written to it (csrc/kernels.h
    cpu_advise_huge_pages: a decode step streams the weights' copies and the KV rows, and every 4 KiB page costs a
    TLB miss).  Returns the bytes advised: 0 off Linux, for a tensor too small to hold a 2 MiB page, or where the
    extension could not be built."""
    try:
        return _C.advise_huge_pages(t)
    except NotImplementedError:
        return 0


def huge_pages_mode() -> str | None:
    """Linux's transparent huge page mode ("always", "madvise" or "never"; advise_huge_pages needs one of the first
    two), or None where the OS has none to report."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def get_num_threads() -> int:
    try:
        return _C.get_num_threads()
    except NotImplementedError:
        return torch.get_num_threads()


def set_isa(name: str) -> None:
    """CPU kernel family: "scalar" (the _generic reference kernels), "avx2", "avx512" (VNNI GEMV) or "amx"
    (AVX-512 GEMV plus AMX tiles for prefill).  Default: the best the CPU and OS support; PYLLM_ISA forces one."""
    try:
        _C.set_isa(name)
    except NotImplementedError as e:
        raise PyllmError(str(e)) from None
    except ValueError as e:
        raise PyllmError(str(e)) from None


def get_isa() -> str | None:
    """The CPU kernel family in use ("scalar", "avx2", "avx512", "amx"), or None without the extension."""
    try:
        return _C.get_isa()
    except NotImplementedError:
        return None
