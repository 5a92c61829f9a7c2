"""Gemma 3 decoder: the llama skeleton with Gemma's differences, reusing llama.py's helpers.

Differences from LlamaModel (each checked against transformers' Gemma3ForCausalLM and llama.cpp's gemma3 graph):
- the input embedding is multiplied by sqrt(n_embd) (the tied output head is not);
- RMSNorm is x * (1 + w); llama.cpp's converter already stored (1 + w) in the file, so the plain rms_norm applies;
- pre- and post-norms around both attention and MLP (post_attention_norm, post_ffw_norm);
- QK-norm, GeGLU with the tanh GELU;
- local layers attend to a sliding window with their own RoPE base (10000); every ``swa_pattern``-th layer is
  global with rope.freq_base (and rope scaling, if any);
- queries scaled by query_pre_attn_scalar**-0.5 (head_dim except for 27B, where it is n_embd / n_head);
- optional soft-capping of the final logits (gemma2-style metadata; gemma3 files normally have none).
"""

from __future__ import annotations

import math

import torch

from ..errors import ModelError
from .config import ModelConfig
from .decoder import Decoder
from .llama import attention, rope_tables


class Gemma3Model(Decoder):
    """One-token forwards take the backend's fused step where it has one, as LlamaModel's do."""

    LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                     "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")

    def __init__(self, cfg: ModelConfig, weights: dict, backend, max_pos: int):
        self.cfg = cfg
        need = ["token_embd.weight", "output_norm.weight"]
        for i in range(cfg.n_layer):
            need += [f"blk.{i}.{n}.weight" for n in self.LAYER_TENSORS]
        missing = [n for n in need if n not in weights]
        if missing:
            raise ModelError(f"{cfg.arch} model is missing tensors: {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        cfg.check_shapes(weights)
        super().__init__(backend, weights)
        ex = cfg.extra
        self.output = weights.get("output.weight", weights["token_embd.weight"])
        self.vec = self.small_vectors(weights)
        pattern = int(ex.get("swa_pattern", 6))
        # llama.cpp and transformers agree: layer i is global when (i + 1) % pattern == 0.
        self.is_global = [pattern <= 0 or (i + 1) % pattern == 0 for i in range(cfg.n_layer)]
        self.window = cfg.sliding_window
        scale_g = float(ex.get("rope_scale", 1.0))  # linear rope scaling applies to the global layers only
        n_tab = max_pos
        self.rope_global = rope_tables(cfg, n_tab, base=cfg.rope_base)
        if scale_g != 1.0:
            self.rope_global = self._scaled(cfg, n_tab, cfg.rope_base, scale_g)
        self.rope_local = rope_tables(cfg, n_tab, base=float(ex.get("rope_local_base", 10000.0)))
        self.rope_global = tuple(t.to(self.device) for t in self.rope_global)
        self.rope_local = tuple(t.to(self.device) for t in self.rope_local)
        self.scale = float(ex.get("query_pre_attn_scalar", cfg.head_dim)) ** -0.5
        # HF multiplies by the embed scale cast to the activation dtype; in float32 that is this float32 value.
        self.embed_scale = torch.tensor(math.sqrt(cfg.n_embd), dtype=torch.float32)
        self.final_softcap = float(ex.get("final_logit_softcapping", 0.0) or 0.0)
        if ex.get("attn_logit_softcapping"):
            raise ModelError(f"{cfg.arch}: attention logit soft-capping is not supported")

    @staticmethod
    def _scaled(cfg, n_pos, base, factor):
        half = cfg.rope_dim // 2
        inv = 1.0 / (base ** (torch.arange(0, half, dtype=torch.float64) * 2.0 / cfg.rope_dim))
        ang = (torch.arange(n_pos, dtype=torch.float64)[:, None] / factor) * inv[None, :]
        return ang.cos().float(), ang.sin().float()

    def forward(self, tokens: torch.Tensor, start_pos: int, kv, all_logits: bool = False) -> torch.Tensor:
        cfg, w, vec, lin, eps = self.cfg, self.w, self.vec, self.linear, self.cfg.rms_eps
        t = tokens.shape[0]
        if t == 1:  # the fused step where it applies (fused_logits says None where not)
            fused = self.fused_logits(int(tokens[0]), start_pos, kv)
            if fused is not None:
                return fused[0].view(1, -1)
        x = self.embed(w["token_embd.weight"], tokens) * self.embed_scale
        sl = slice(start_pos, start_pos + t)
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            glob = self.is_global[i]
            cos, sin = self.rope_global if glob else self.rope_local
            h = self.norm(x, vec[p + "attn_norm.weight"], eps)
            q = lin(h, w[p + "attn_q.weight"]).view(t, cfg.n_head, cfg.head_dim)
            k = lin(h, w[p + "attn_k.weight"]).view(t, cfg.n_kv_head, cfg.head_dim)
            v = lin(h, w[p + "attn_v.weight"]).view(t, cfg.n_kv_head, cfg.head_dim)
            q = self.norm(q, vec[p + "attn_q_norm.weight"], eps)
            k = self.norm(k, vec[p + "attn_k_norm.weight"], eps)
            q = self.rope(q, cos[sl], sin[sl], cfg.rope_style, cfg.rope_dim)
            k = self.rope(k, cos[sl], sin[sl], cfg.rope_style, cfg.rope_dim)
            kv.update(i, start_pos, k, v, q=q)
            window = 0 if glob else int(self.window or 0)
            if start_pos == 0:
                # A fresh prompt attends to its own float32 keys, not to their rounded cache copies.
                a = self.causal_attention(q, k, v, self.scale, window, attention)
            else:  # quantized/rotated caches attend in their own storage
                a = kv.attend(i, q, start_pos, self.cache_attention(self.scale, window, attention))
            a = lin(a, w[p + "attn_output.weight"])
            x = x + self.norm(a, vec[p + "post_attention_norm.weight"], eps)
            h = self.norm(x, vec[p + "ffn_norm.weight"], eps)
            g = lin(h, w[p + "ffn_gate.weight"])
            u = lin(h, w[p + "ffn_up.weight"])
            m = lin(self.glu(g, u, gelu_tanh=True), w[p + "ffn_down.weight"])
            x = x + self.norm(m, vec[p + "post_ffw_norm.weight"], eps)
        if not all_logits:
            x = x[-1:]
        x = self.norm(x, vec["output_norm.weight"], eps)
        logits = self.output_linear(x, self.output)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return self.to_cpu(logits)

    def decode_options(self) -> dict:
        # Local layers: rope table 1 (rope_local_base) and the sliding window; global layers: table 0, full attention.
        return dict(bias=False, qk_norm=True, cos=self.rope_global[0], sin=self.rope_global[1], window=0,
                    post_norms=True, embd_scale=float(self.embed_scale), act="gelu_tanh",
                    final_softcap=self.final_softcap, cos2=self.rope_local[0].contiguous(),
                    sin2=self.rope_local[1].contiguous(), layer_rope=[0 if g else 1 for g in self.is_global],
                    layer_window=[0 if g else int(self.window or 0) for g in self.is_global])
