"""One decoder for the llama family (llama/SmolLM2, mistral, qwen2, qwen3), driven by ModelConfig flags.

Activations are float32 on the backend's device. Weights stay quantized (QTensor) and go through the backend's
``linear`` on every use, so the kernels decide how they are read: the fused dequantize-in-GEMV for decode,
dequantize + matmul for prefill (pyllm/backends).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import ModelError
from .config import ModelConfig
from .decoder import Decoder

Linear = Callable[[torch.Tensor, object], torch.Tensor]  # (x [T, K] f32, QTensor [N, K]) -> [T, N] f32


def rope_tables(cfg: ModelConfig, n_pos: int, base: float | None = None,
                freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [n_pos, rope_dim/2] float32. freq_factors (llama3 rope_freqs) divide the frequencies."""
    base = cfg.rope_base if base is None else base
    half = cfg.rope_dim // 2
    inv = 1.0 / (base ** (torch.arange(0, half, dtype=torch.float64) * 2.0 / cfg.rope_dim))
    if freq_factors is not None:
        inv = inv / freq_factors.double()[:half]
    ang = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int, scale: float,
              window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal grouped-query attention.

    q: [T, H, hd] for positions start_pos..start_pos+T-1; k, v: [Hkv, S, hd] for positions 0..S-1.
    window > 0 limits each query to the last ``window`` positions (sliding-window layers). Returns [T, H*hd].
    """
    t, h, hd = q.shape
    s = k.shape[1]
    qh = q.transpose(0, 1)  # [H, T, hd]
    mask = None
    if t > 1 or window:
        qpos = torch.arange(start_pos, start_pos + t, device=q.device)[:, None]
        kpos = torch.arange(s, device=q.device)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
    if softcap:
        raise ModelError("attention logit soft-capping is not supported")
    out = F.scaled_dot_product_attention(qh[None], k[None], v[None], attn_mask=mask, scale=scale,
                                         enable_gqa=h != k.shape[0])[0]
    return out.transpose(0, 1).reshape(t, h * v.shape[-1])


class LlamaModel(Decoder):
    """The llama-family decoder. ``weights`` maps GGUF tensor names to QTensors (still quantized); ``backend``
    (pyllm/backends) runs them. One-token forwards take the backend's fused step where it has one (the CPU's C++
    decode step reads every cache kind but bf16 directly, csrc/cpu/attention.cpp)."""

    def __init__(self, cfg: ModelConfig, weights: dict, backend, max_pos: int):
        self.cfg = cfg
        need = ["token_embd.weight", "output_norm.weight"]
        for i in range(cfg.n_layer):
            need += [f"blk.{i}.{n}.weight" for n in
                     ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                      "ffn_down")]
        missing = [n for n in need if n not in weights]
        if missing:
            raise ModelError(f"{cfg.arch} model is missing tensors: {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        cfg.check_shapes(weights)
        super().__init__(backend, weights)
        weights = self.w
        self.output = weights.get("output.weight", weights["token_embd.weight"])
        self.vec = self.small_vectors(weights)
        ff = weights.get("rope_freqs.weight")
        cos, sin = rope_tables(cfg, max_pos, freq_factors=None if ff is None else self.vec["rope_freqs.weight"].cpu())
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def decode_options(self) -> dict:
        cfg = self.cfg
        return dict(bias=cfg.qkv_bias, qk_norm=cfg.qk_norm, cos=self.cos, sin=self.sin, window=cfg.sliding_window)

    def forward(self, tokens: torch.Tensor, start_pos: int, kv, all_logits: bool = False) -> torch.Tensor:
        """tokens: [T] int64 at positions start_pos.. ; kv: KVCache. Returns logits [T or 1, n_vocab] f32."""
        cfg, w, vec, lin = self.cfg, self.w, self.vec, self.linear
        t = tokens.shape[0]
        if t == 1:  # the fused step where it applies (fused_logits says None where not)
            fused = self.fused_logits(int(tokens[0]), start_pos, kv)
            if fused is not None:
                return fused[0].view(1, -1)
        x = self.embed(w["token_embd.weight"], tokens)  # [T, D]
        cos, sin = self.cos[start_pos:start_pos + t], self.sin[start_pos:start_pos + t]
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            h = self.norm(x, vec[p + "attn_norm.weight"], cfg.rms_eps)
            q = lin(h, w[p + "attn_q.weight"])
            k = lin(h, w[p + "attn_k.weight"])
            v = lin(h, w[p + "attn_v.weight"])
            if cfg.qkv_bias:
                q = q + vec[p + "attn_q.bias"]
                k = k + vec[p + "attn_k.bias"]
                v = v + vec[p + "attn_v.bias"]
            q = q.view(t, cfg.n_head, cfg.head_dim)
            k = k.view(t, cfg.n_kv_head, cfg.head_dim)
            v = v.view(t, cfg.n_kv_head, cfg.head_dim)
            if cfg.qk_norm:
                q = self.norm(q, vec[p + "attn_q_norm.weight"], cfg.rms_eps)
                k = self.norm(k, vec[p + "attn_k_norm.weight"], cfg.rms_eps)
            q = self.rope(q, cos, sin, cfg.rope_style, cfg.rope_dim)
            k = self.rope(k, cos, sin, cfg.rope_style, cfg.rope_dim)
            kv.update(i, start_pos, k, v, q=q)
            if start_pos == 0:
                # A fresh prompt attends to its own keys in float32, not to their rounded cache copies.
                a = self.causal_attention(q, k, v, self.scale, cfg.sliding_window, attention)
            else:
                # The cache runs attention over its own storage (a rotated cache attends in its rotated basis).
                a = kv.attend(i, q, start_pos, self.cache_attention(self.scale, cfg.sliding_window, attention))
            x = x + lin(a, w[p + "attn_output.weight"])
            h = self.norm(x, vec[p + "ffn_norm.weight"], cfg.rms_eps)
            g = lin(h, w[p + "ffn_gate.weight"])
            u = lin(h, w[p + "ffn_up.weight"])
            x = x + lin(self.glu(g, u), w[p + "ffn_down.weight"])
        if not all_logits:
            x = x[-1:]
        x = self.norm(x, vec["output_norm.weight"], cfg.rms_eps)
        return self.to_cpu(self.output_linear(x, self.output))
