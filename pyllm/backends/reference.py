"""The reference backend: float32 matmuls on weights dequantized by the torch reference code (quant.py), the path
the tests tie to transformers. Each weight is dequantized on first use and kept: it trades memory for speed, so it
is for tests and accuracy baselines, never the default. It has no fused decode step."""

from __future__ import annotations

import torch

from .base import SeqStep, StepRows, step_each


class ReferenceBackend:
    name = "reference"
    device = torch.device("cpu")

    def __init__(self):
        self._dense: dict[int, tuple[object, torch.Tensor]] = {}  # id(w) -> (w, W f32); w kept so the id stays

    def describe(self) -> dict:
        return {"backend": self.name, "device": "cpu", "threads": torch.get_num_threads()}

    def prepare_weights(self, weights: dict, progress: bool = False) -> dict:
        return weights

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        hit = self._dense.get(id(w))
        if hit is None:
            hit = self._dense[id(w)] = (w, w.dequantize(torch.float32))
        return x @ hit[1].T

    linear_output = linear

    def embed(self, w, ids: torch.Tensor) -> torch.Tensor:
        return w.rows(ids).float()

    def make_kv_cache(self, kind: str, n_layer: int, n_kv_head: int, max_seq: int, head_dim: int):
        from ..runtime.kv_cache import KVCache

        return KVCache(n_layer, n_kv_head, max_seq, head_dim, kind, device=self.device)

    def make_kv_pool(self, kind: str, n_layer: int, n_kv_head: int, head_dim: int, n_blocks: int,
                     block_rows: int):
        from ..runtime.kv_pool import BlockPool

        return BlockPool(kind, n_layer, n_kv_head, head_dim, n_blocks, block_rows, device=self.device)

    def fused_decode(self, model, kv):
        return None

    def step(self, model, seqs: list[SeqStep]) -> list[StepRows]:
        """The multi-sequence step as the plain torch forward of each sequence in turn: the oracle."""
        return step_each(model, seqs, max_rows=0)
