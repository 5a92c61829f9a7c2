"""Random GGUF weights for the CUDA tests: random quant bytes with finite fp16 scales sized so a row's values
have roughly unit-variance dot products with unit inputs, plus the gguf.quants float64 reference."""

from __future__ import annotations

import numpy as np
import torch

from pyllm.gguf import BLOCK_INFO, GGMLType

# (byte offset, magnitude factor) of each fp16 scale field; value ~ factor / sqrt(K) keeps weights ~ 1/sqrt(K)
SCALES = {
    GGMLType.Q4_0: [(0, 1 / 4.6)],
    GGMLType.Q4_1: [(0, 1 / 4.6), (2, -7.5 / 4.6)],
    GGMLType.Q5_0: [(0, 1 / 9.2)],
    GGMLType.Q5_1: [(0, 1 / 9.2), (2, -15.5 / 9.2)],
    GGMLType.Q8_0: [(0, 1 / 74.0)],
    GGMLType.Q2_K: [(80, 1 / 8.0), (82, 1 / 16.0)],
    GGMLType.Q3_K: [(108, 1 / 40.0)],
    GGMLType.Q4_K: [(0, 1 / 140.0), (2, 1 / 60.0)],
    GGMLType.Q5_K: [(0, 1 / 280.0), (2, 1 / 60.0)],
    GGMLType.Q6_K: [(208, 1 / 2000.0)],
}


def random_blocks(qtype: GGMLType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row_bytes] of valid random blocks."""
    bs, ts = BLOCK_INFO[qtype]
    raw = rng.integers(0, 256, size=(n * (k // bs), ts), dtype=np.uint8)
    for off, f in SCALES[qtype]:
        vals = (f / np.sqrt(k)) * rng.uniform(0.5, 1.5, size=raw.shape[0]) * rng.choice([-1, 1], size=raw.shape[0])
        raw[:, off:off + 2] = vals.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def reference(qtype: GGMLType, blocks: np.ndarray) -> np.ndarray:
    """gguf.quants' dequantization (float32, as the file format defines it)."""
    from gguf import quants

    return quants.dequantize(blocks, int(qtype))


def to_cuda(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()
