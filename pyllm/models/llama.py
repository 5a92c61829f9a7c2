"""One decoder for the llama family (llama/SmolLM2, mistral, qwen2, qwen3), driven by ModelConfig flags.

Activations are float32 on the CPU. Weights stay quantized (QTensor) and go through ``linear`` on every use, so
the kernels decide how they are read: the fused dequantize-in-GEMV for decode, dequantize + matmul for prefill.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F

from .. import ops
from ..errors import ModelError
from .config import ModelConfig

Linear = Callable[[torch.Tensor, object], torch.Tensor]  # (x [T, K] f32, QTensor [N, K]) -> [T, N] f32


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, D] f32; w: [D]. Computed in float32 like llama.cpp's ggml_rms_norm."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str, rope_dim: int) -> torch.Tensor:
    """x: [T, H, hd]; cos/sin: [T, rope_dim/2]. Rotates the first rope_dim dims of each head."""
    c, s = cos[:, None, :], sin[:, None, :]
    xr = x[..., :rope_dim]
    if style == "neox":
        half = rope_dim // 2
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    if rope_dim == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rope_dim:]), dim=-1)


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
        qpos = torch.arange(start_pos, start_pos + t)[:, None]
        kpos = torch.arange(s)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
    if softcap:
        raise ModelError("attention logit soft-capping is not supported")
    out = F.scaled_dot_product_attention(qh[None], k[None], v[None], attn_mask=mask, scale=scale,
                                         enable_gqa=h != k.shape[0])[0]
    return out.transpose(0, 1).reshape(t, h * v.shape[-1])


class LlamaModel:
    """The llama-family decoder. ``weights`` maps GGUF tensor names to QTensors (still quantized)."""

    # Decode (one token) runs as one extension call (csrc/cpu/decode_step.cpp) when the fast kernels and a CPU
    # KVCache are in use (any kind: the step attends over quantized rows directly, csrc/cpu/attention.cpp); False
    # forces the torch path below (tests compare the two).
    use_cpp_decode = True
    _decode_ctx = None  # (kv, its key storage, DecodeContext or None when that kv/model cannot use the C++ step)

    def __init__(self, cfg: ModelConfig, weights: dict, linear: Linear, embed: Callable, max_pos: int):
        self.cfg = cfg
        self.w = weights
        self.linear = linear
        self.embed = embed  # (QTensor, ids [T]) -> [T, D] f32: dequantizes only the rows looked up
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
        self.output = weights.get("output.weight", weights["token_embd.weight"])
        # The fast backend's output projection keeps 16-bit activations (ops.qmatmul_output), as decode_step does.
        self.output_linear = ops.qmatmul_output if linear is ops.qmatmul else linear
        # Norm weights and biases are tiny: keep them as float32 tensors.
        self.vec = {n: t.dequantize().reshape(-1) for n, t in weights.items() if len(t.shape) == 1}
        ff = weights.get("rope_freqs.weight")
        self.cos, self.sin = rope_tables(cfg, max_pos, freq_factors=None if ff is None else self.vec["rope_freqs.weight"])
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def forward(self, tokens: torch.Tensor, start_pos: int, kv, all_logits: bool = False) -> torch.Tensor:
        """tokens: [T] int64 at positions start_pos.. ; kv: KVCache. Returns logits [T or 1, n_vocab] f32."""
        cfg, w, vec, lin = self.cfg, self.w, self.vec, self.linear
        t = tokens.shape[0]
        if t == 1 and self.use_cpp_decode:
            logits = self._cpp_decode(tokens, start_pos, kv)
            if logits is not None:
                return logits
        x = self.embed(w["token_embd.weight"], tokens)  # [T, D]
        cos, sin = self.cos[start_pos:start_pos + t], self.sin[start_pos:start_pos + t]
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            h = rms_norm(x, vec[p + "attn_norm.weight"], cfg.rms_eps)
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
                q = rms_norm(q, vec[p + "attn_q_norm.weight"], cfg.rms_eps)
                k = rms_norm(k, vec[p + "attn_k_norm.weight"], cfg.rms_eps)
            q = apply_rope(q, cos, sin, cfg.rope_style, cfg.rope_dim)
            k = apply_rope(k, cos, sin, cfg.rope_style, cfg.rope_dim)
            kv.update(i, start_pos, k, v, q=q)
            if start_pos == 0:
                # A fresh prompt attends to its own keys in float32, not to their rounded cache copies.
                a = attention(q, k.transpose(0, 1), v.transpose(0, 1), start_pos, self.scale, cfg.sliding_window)
            else:
                # The cache runs attention over its own storage (a rotated cache attends in its rotated basis).
                a = kv.attend(i, q, start_pos, functools.partial(attention, start_pos=start_pos, scale=self.scale,
                                                                 window=cfg.sliding_window))
            x = x + lin(a, w[p + "attn_output.weight"])
            h = rms_norm(x, vec[p + "ffn_norm.weight"], cfg.rms_eps)
            g = lin(h, w[p + "ffn_gate.weight"])
            u = lin(h, w[p + "ffn_up.weight"])
            x = x + lin(F.silu(g) * u, w[p + "ffn_down.weight"])
        if not all_logits:
            x = x[-1:]
        x = rms_norm(x, vec["output_norm.weight"], cfg.rms_eps)
        return self.output_linear(x, self.output)

    def _cpp_decode(self, tokens: torch.Tensor, start_pos: int, kv) -> torch.Tensor | None:
        """Logits [1, n_vocab] of one token via the extension's decode_step, or None where it does not apply."""
        ctx = self.decode_context(kv)
        if ctx is None:
            return None
        kv._check(start_pos, 1)
        logits = torch.empty(1, ctx.n_vocab)
        ops._C.decode_step(ctx, int(tokens[0]), start_pos, logits)
        return logits

    def decode_context(self, kv):
        """The extension's DecodeContext for ``kv`` (built once per cache), or None where the C++ step does not
        apply now (see make_decode_ctx; and the first steps of a centered cache estimate its means in torch)."""
        c = self._decode_ctx
        part = getattr(getattr(kv, "k_part", None), "data", None)
        if c is None or c[0] is not kv or c[1] is not part:
            c = self._decode_ctx = (kv, part, self._make_decode_ctx(kv))
        return c[2] if c[2] is not None and kv.means_ready() else None

    def _make_decode_ctx(self, kv):
        cfg = self.cfg
        return make_decode_ctx(self, kv, bias=cfg.qkv_bias, qk_norm=cfg.qk_norm, cos=self.cos, sin=self.sin,
                               window=cfg.sliding_window)


def make_decode_ctx(model, kv, *, bias: bool, qk_norm: bool, cos, sin, window: int, **extra):
    """The extension's DecodeContext for ``model`` (LlamaModel or Gemma3Model) and ``kv``, or None where the C++
    step does not apply: not the fast qmatmul/embedding ops, not a CPU KVCache of kinds the step stores (bf16
    is not), no extension, or a weight type / layout it does not take.  ``extra``: the context's Gemma options
    (post norms, act, ...)."""
    from ..runtime.kv_cache import KVCache

    if (model.linear is not ops.qmatmul or model.embed is not ops.embedding or ops.get_backend() != "fast"
            or not isinstance(kv, KVCache) or kv.k_part.data.device.type != "cpu"):
        return None
    try:
        kvx = kv_cache_args(kv)
    except KeyError:  # a kind the C++ step does not store (bf16)
        return None
    cfg, w, vec = model.cfg, model.w, model.vec
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    mats = [w[f"blk.{i}.{n}.weight"] for i in range(cfg.n_layer) for n in names]

    def vecs(name, on=True):
        return [vec[f"blk.{i}.{name}"].float().contiguous() for i in range(cfg.n_layer)] if on else []

    try:
        if extra.get("post_norms"):
            extra.update(post_attn_norm=vecs("post_attention_norm.weight"), post_ffw_norm=vecs("post_ffw_norm.weight"))
        extra.pop("post_norms", None)
        return ops._C.DecodeContext(
            [m.data for m in mats], [int(m.qtype) for m in mats], vecs("attn_norm.weight"),
            vecs("ffn_norm.weight"), vecs("attn_q.bias", bias), vecs("attn_k.bias", bias),
            vecs("attn_v.bias", bias), vecs("attn_q_norm.weight", qk_norm),
            vecs("attn_k_norm.weight", qk_norm), w["token_embd.weight"].data, int(w["token_embd.weight"].qtype),
            model.output.data, int(model.output.qtype), vec["output_norm.weight"].float().contiguous(),
            cos.contiguous(), sin.contiguous(), kvx["k_cache"], kvx["v_cache"], cfg.n_embd, cfg.n_ff, cfg.n_head,
            cfg.n_kv_head, cfg.head_dim, cfg.rope_dim, cfg.rope_style, cfg.rms_eps, model.scale,
            window, k_type=kvx["k_type"], v_type=kvx["v_type"], k_mu=kvx["k_mu"], v_mu=kvx["v_mu"],
            k_rot=kvx["k_rot"], v_rot=kvx["v_rot"], k_scale=kvx["k_scale"], k_sink=kvx["k_sink"],
            v_sink=kvx["v_sink"], **extra)
    except (NotImplementedError, AttributeError, ValueError, TypeError, KeyError):
        # No extension, a GGML type the CPU kernels lack, or a layout the step does not take: torch path.
        return None


KV_TYPE_IDS = {"f32": 0, "f16": 1, "q8_0": 2, "q4_0": 3, "q4_rot": 3, "q8_rot": 2}  # csrc/kernels.h KVType


def kv_cache_args(kv) -> dict:
    """The DecodeContext arguments describing ``kv``'s storage: per part its tensor, KVType id, mean and key scale
    (the live tensors, updated in place when the cache re-estimates them), rotation R and exact sink row (written
    by the step at position 0). KeyError for kinds it cannot store."""
    out = {}
    for name, p in (("k", kv.k_part), ("v", kv.v_part)):
        out[f"{name}_type"] = KV_TYPE_IDS[p.kind]
        out[f"{name}_cache"] = p.data
        out[f"{name}_mu"] = p.mu if getattr(p, "centered", False) else None
        out[f"{name}_rot"] = p.rot.contiguous() if p.rot is not None else None
        out[f"{name}_sink"] = getattr(p, "sink", None)
    out["k_scale"] = kv.k_part.scale if getattr(kv.k_part, "scaled", False) else None
    return out
