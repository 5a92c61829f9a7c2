"""The KV cache: one preallocated buffer per model, written at a position and read up to a length.

Quantized variants (q8_0, q4_0, rotated 4-bit) subclass KVCache and keep the same update/view interface.
"""

from __future__ import annotations

import torch

from ..errors import PyllmError

KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class KVCache:
    """Keys and values of every layer for up to ``max_seq`` positions.

    k, v: (n_layer, n_kv_head, max_seq, head_dim) in ``dtype``. Positions past the valid length hold stale values;
    the runtime tracks the valid length, so truncating the cache (prefix reuse) costs nothing.
    """

    kind = "f16"

    def __init__(self, n_layer: int, n_kv_head: int, max_seq: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu"):
        self.n_layer, self.n_kv_head, self.max_seq, self.head_dim = n_layer, n_kv_head, max_seq, head_dim
        self.dtype = dtype
        shape = (n_layer, n_kv_head, max_seq, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(n_layer: int, n_kv_head: int, head_dim: int, kind: str = "f16") -> float:
        elem = {"f32": 4, "f16": 2, "bf16": 2}[kind]
        return 2.0 * n_layer * n_kv_head * head_dim * elem

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def update(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v: (T, n_kv_head, head_dim) at positions pos..pos+T-1 of ``layer``."""
        t = k.shape[0]
        if pos < 0 or pos + t > self.max_seq:
            raise PyllmError(f"KV cache holds {self.max_seq} positions; cannot write {t} at position {pos}")
        self.k[layer, :, pos:pos + t] = k.transpose(0, 1).to(self.dtype)
        self.v[layer, :, pos:pos + t] = v.transpose(0, 1).to(self.dtype)

    def view(self, layer: int, upto: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions 0..upto-1 as (n_kv_head, upto, head_dim) in ``dtype`` (a copy unless dtype matches)."""
        return (self.k[layer, :, :upto].to(dtype), self.v[layer, :, :upto].to(dtype))


def make_kv_cache(kind: str, n_layer: int, n_kv_head: int, max_seq: int, head_dim: int,
                  device: str | torch.device = "cpu") -> KVCache:
    if kind in KV_DTYPES:
        c = KVCache(n_layer, n_kv_head, max_seq, head_dim, KV_DTYPES[kind], device)
        c.kind = kind
        return c
    raise PyllmError(f"unknown KV cache type {kind!r}; choose one of: {', '.join(KV_DTYPES)}")
