"""The two ways a model's linear layers and embedding lookups can run (injected into the model).

- "fast": the extension's kernels (fused dequantize-in-GEMV for decode, dequantize + matmul for prefill).
- "reference": float32 matmul on weights dequantized by the torch reference code in quant.py, the path the
  tests tie to transformers. Each weight is dequantized on first use and kept (for tests and accuracy baselines:
  it trades memory for speed, so it is never the default).
"""

from __future__ import annotations

from typing import Callable

import torch


def reference_functions() -> tuple[Callable, Callable]:
    dense: dict[int, tuple[object, torch.Tensor]] = {}

    def linear(x: torch.Tensor, w) -> torch.Tensor:
        hit = dense.get(id(w))
        if hit is None:
            hit = dense[id(w)] = (w, w.dequantize(torch.float32))
        return x @ hit[1].T

    def embed(w, ids: torch.Tensor) -> torch.Tensor:
        return w.rows(ids).float()

    return linear, embed


def linear_functions(backend: str, n_threads: int | None = None) -> tuple[Callable, Callable]:
    """(linear(x [T,K] f32, w QTensor [N,K]) -> [T,N] f32, embed(w, ids [T]) -> [T,K] f32) for a backend."""
    if backend == "reference":
        return reference_functions()
    from . import ops

    if n_threads:
        ops.set_num_threads(n_threads)

    return ops.qmatmul, ops.embedding
