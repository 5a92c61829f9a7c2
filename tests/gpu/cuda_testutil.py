"""Random GGUF weights for the CUDA tests: random quant bytes with finite fp16 scales sized so a row's values
have roughly unit-variance dot products with unit inputs, plus the gguf.quants float64 reference; and the float64
definition of the decode attention over a KV cache's stored rows (also used by the CPU-side tests)."""

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


def stored_rows(data: torch.Tensor, block: str) -> torch.Tensor:
    """Rows of one layer's cache part as float64 [Hkv, S, hd]: float rows as they are, q8_0 / q4_0 blocks through
    pyllm/runtime/kv_cache.py's own dequantizers (the definition both the CPU step and csrc/cuda follow)."""
    from pyllm.runtime import kv_cache

    if not block:
        return data.double()
    hkv, s, rb = data.shape
    bb = kv_cache.BLOCK_BYTES[block]
    b = data.reshape(hkv, s, rb // bb, bb)
    d = b[..., :2].contiguous().view(torch.float16)[..., 0]
    if block == "q8_0":
        x = kv_cache.dequantize_q8_0(b[..., 2:].contiguous().view(torch.int8), d)
    else:
        x = kv_cache.dequantize_q4_0(b[..., 2:].contiguous(), d)
    return x.reshape(hkv, s, -1).double()


def reference_attn_decode(q: torch.Tensor, k, v, length: int, scale: float, window: int = 0,
                          softcap: float = 0.0) -> torch.Tensor:
    """float64 definition of csrc/cuda/attention.cu: q [H, hd] (keys' storage basis) over one layer's parts k, v
    (pyllm.backends.cuda.AttnPart), positions max(0, length - window) .. length - 1, position 0 from the sink
    rows where a part has them, scores softcapped when softcap > 0.  Returns [H, hd] float64 (values' basis)."""
    kk = stored_rows(k.data, k.block)[:, :length].clone()
    vv = stored_rows(v.data, v.block)[:, :length].clone()
    if k.sink is not None:
        kk[:, 0] = k.sink.double()
    if v.sink is not None:
        vv[:, 0] = v.sink.double()
    lo = max(0, length - window) if window else 0
    kk, vv = kk[:, lo:], vv[:, lo:]
    g = q.shape[0] // kk.shape[0]
    s = torch.einsum("hd,hsd->hs", q.double() * scale, kk.repeat_interleave(g, 0))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return torch.einsum("hs,hsd->hd", torch.softmax(s, -1), vv.repeat_interleave(g, 0))
