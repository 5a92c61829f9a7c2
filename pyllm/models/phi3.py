"""Phi-3: the llama decoder once its fused tensors are split.

Phi-3 GGUFs keep attn_qkv ([q; k; v] rows) and ffn_up ([gate; up] rows) fused, as the checkpoint does. Rows of a
QTensor are whole blocks, so splitting is a zero-copy row slice of the raw data: the weights stay quantized and
LlamaModel runs unchanged (NeoX rotation, optional sliding window).
"""

from __future__ import annotations

from ..errors import ModelError
from ..quant import QTensor
from .config import ModelConfig
from .llama import LlamaModel


def _rows(t: QTensor, start: int, stop: int, name: str) -> QTensor:
    return QTensor(t.qtype, (stop - start, t.shape[1]), t.data[start:stop], name)


def split_fused(cfg: ModelConfig, weights: dict) -> dict:
    w = dict(weights)
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        qkv = w.pop(p + "attn_qkv.weight", None)
        if qkv is not None:
            if qkv.shape[0] != q + 2 * kv:
                raise ModelError(f"{p}attn_qkv.weight has {qkv.shape[0]} rows, expected {q + 2 * kv}")
            w[p + "attn_q.weight"] = _rows(qkv, 0, q, p + "attn_q.weight")
            w[p + "attn_k.weight"] = _rows(qkv, q, q + kv, p + "attn_k.weight")
            w[p + "attn_v.weight"] = _rows(qkv, q + kv, q + 2 * kv, p + "attn_v.weight")
        up = w.get(p + "ffn_up.weight")
        if up is not None and p + "ffn_gate.weight" not in w:
            if up.shape[0] != 2 * cfg.n_ff:
                raise ModelError(f"{p}ffn_up.weight has {up.shape[0]} rows, expected 2 x {cfg.n_ff} (gate; up)")
            w[p + "ffn_gate.weight"] = _rows(up, 0, cfg.n_ff, p + "ffn_gate.weight")
            w[p + "ffn_up.weight"] = _rows(up, cfg.n_ff, 2 * cfg.n_ff, p + "ffn_up.weight")
    return w


class Phi3Model(LlamaModel):
    arrange_weights = staticmethod(split_fused)  # before the backend prepares them: slicing file rows is free

    def __init__(self, cfg: ModelConfig, weights: dict, backend, max_pos: int):
        super().__init__(cfg, split_fused(cfg, weights), backend, max_pos)
