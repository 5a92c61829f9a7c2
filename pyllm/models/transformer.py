"""The one torch forward, for every architecture: a decoder-only transformer whose layers ArchSpec describes
(models/spec.py).  No architecture name is read here; what differs between families is a spec entry (norm
placement, activation, rope tables per layer, windows, scales) or a weight adapter (``arrange_weights``).

Activations are float32 on the backend's device.  Weights stay quantized (QTensor) and go through the backend's
``linear`` on every use, so the kernels decide how they are read: the fused dequantize-in-GEMV for decode,
dequantize + matmul for prefill (pyllm/backends).  This forward is the reference the fused steps (the C++ step,
the CUDA step) are tested against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import ModelError
from ..formats.quant import QTensor
from .config import ModelConfig
from .decoder import Decoder
from .spec import ArchSpec, YarnSpec


def yarn_frequencies(yarn: YarnSpec, base: float, rope_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rope_dim/2] float64, the cos / sin factor) of YaRN rope scaling, as transformers'
    _compute_yarn_parameters computes them (spec.py YarnSpec says what)."""
    half = rope_dim // 2
    pos_freqs = base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(yarn.orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp
    extrapolate = 1 - ((torch.arange(half, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv = (1 / (yarn.factor * pos_freqs)) * (1 - extrapolate) + (1 / pos_freqs) * extrapolate
    return inv, (0.1 * math.log(yarn.factor) + 1.0 if yarn.factor > 1 else 1.0)


def rope_tables(cfg: ModelConfig, n_pos: int, base: float | None = None, freq_factors: torch.Tensor | None = None,
                scale: float = 1.0, yarn: YarnSpec | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [n_pos, rope_dim/2] float32. freq_factors (llama3 rope_freqs) divide the frequencies; ``scale``
    (linear rope scaling) divides the positions; ``yarn`` replaces the frequencies and scales cos and sin."""
    base = cfg.rope_base if base is None else base
    half = cfg.rope_dim // 2
    inv = 1.0 / (base ** (torch.arange(0, half, dtype=torch.float64) * 2.0 / cfg.rope_dim))
    mscale = 1.0
    if yarn is not None:
        inv, mscale = yarn_frequencies(yarn, base, cfg.rope_dim)
    if freq_factors is not None:
        inv = inv / freq_factors.double()[:half]
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]
    ang = (pos if scale == 1.0 else pos / scale) * inv[None, :]
    if mscale != 1.0:
        return (ang.cos() * mscale).float(), (ang.sin() * mscale).float()
    return ang.cos().float(), ang.sin().float()


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int, scale: float, window: int,
                   sinks: torch.Tensor) -> torch.Tensor:
    """``attention`` with a sink logit per head (sinks [H]) in each softmax's denominator (gpt-oss): the sink takes
    its share of the probability and contributes no value.  q [T, H, hd]; k, v [Hkv, S, hd] -> [T, H*hd]."""
    t, h, hd = q.shape
    s, g = k.shape[1], h // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)  # [H, S, hd]
    scores = torch.einsum("thd,hsd->hts", q, k) * scale
    qpos = torch.arange(start_pos, start_pos + t, device=q.device)[:, None]
    kpos = torch.arange(s, device=q.device)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat((scores, sinks.reshape(h, 1, 1).expand(h, t, 1).to(scores.dtype)), dim=-1)
    p = torch.softmax(logits, dim=-1)[..., :-1]
    return (p @ v).transpose(0, 1).reshape(t, h * v.shape[-1])


def swiglu_oai(g: torch.Tensor, u: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU (spec.py ACTIVATIONS), in transformers' order of operations."""
    g = g.clamp(max=limit)
    return (u.clamp(-limit, limit) + 1) * (g * torch.sigmoid(g * alpha))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int | torch.Tensor, scale: float,
              window: int = 0) -> torch.Tensor:
    """Causal grouped-query attention.

    q: [T, H, hd] for positions start_pos..start_pos+T-1; k, v: [Hkv, S, hd] for positions 0..S-1.
    window > 0 limits each query to the last ``window`` positions (sliding-window layers). Returns [T, H*hd].
    start_pos may be a device-held int64 [1] tensor: then k, v may hold rows past the queries' positions (a whole
    cache), which the mask leaves out.
    """
    t, h, hd = q.shape
    s = k.shape[1]
    qh = q.transpose(0, 1)  # [H, T, hd]
    mask = None
    if t > 1 or window or isinstance(start_pos, torch.Tensor):
        qpos = (start_pos + torch.arange(t, device=q.device))[:, None]
        kpos = torch.arange(s, device=q.device)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
    out = F.scaled_dot_product_attention(qh[None], k[None], v[None], attn_mask=mask, scale=scale,
                                         enable_gqa=h != k.shape[0])[0]
    return out.transpose(0, 1).reshape(t, h * v.shape[-1])


# ---- weight adapters: a file's tensors as the forward names them ------------------------------------------------

def _rows(t: QTensor, start: int, stop: int, name: str) -> QTensor:
    return QTensor(t.qtype, (stop - start, t.shape[1]), t.data[start:stop], name)


def split_fused(cfg: ModelConfig, weights: dict) -> dict:
    """Phi-3's attn_qkv ([q; k; v] rows) and ffn_up ([gate; up] rows) as separate tensors.  Rows of a QTensor are
    whole blocks, so each split is a zero-copy row slice of the raw data: the weights stay quantized."""
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


# Rows of a fresh prompt that attend to their own float32 keys (Transformer.forward_on_device): the first chunk the
# server's engine reads (runtime/prompt_cache.py PREFILL_CHUNK), the rows that also fix a quantized cache's means.
FRESH_ROWS = 64


class Transformer(Decoder):
    """The decoder for every architecture.  ``weights`` maps GGUF tensor names to QTensors (still quantized);
    ``backend`` (pyllm/backends) runs them.  One-token forwards take the backend's fused step where it has one.

    What the fused steps read besides the weights: ``spec`` (ArchSpec), ``rope_tables`` (the distinct (cos, sin)
    tables, [max_pos, rope_dim/2] each), ``layer_rope`` (each layer's index into them, -1 for a layer without rope),
    ``vec`` (1-D float32 tensors)."""

    def __init__(self, cfg: ModelConfig, weights: dict, backend, max_pos: int, spec: ArchSpec | None = None):
        self.cfg = cfg
        self.spec = spec = ArchSpec.from_config(cfg, weights) if spec is None else spec
        need = ["token_embd.weight", "output_norm.weight"]
        for i in range(cfg.n_layer):
            need += [f"blk.{i}.{n}" for n in spec.layer_tensors()]
        missing = [n for n in need if n not in weights]
        if missing:
            raise ModelError(f"{cfg.arch} model is missing tensors: {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        cfg.check_shapes(weights)
        super().__init__(backend, weights)
        weights = self.w
        self.output = weights.get("output.weight", weights["token_embd.weight"])
        self.vec = self.small_vectors(weights)
        factors = self.vec["rope_freqs.weight"].cpu() if spec.rope_freq_factors else None
        keys, self.layer_rope = spec.rope_keys()
        self.rope_tables = [tuple(t.to(self.device) for t in rope_tables(cfg, max_pos, base, factors, scale,
                                                                       spec.yarn))
                            for base, scale in keys]
        # the experts' biases [n_expert, rows] (2-D, so not among the small vectors), as float32 on their layer's device
        self.expert_bias = {n: t.dequantize().to(self.tensor_device(n)) for n, t in weights.items()
                            if spec.expert_bias and n.endswith("_exps.bias")}
        # multiplied as a float32 tensor, as HF multiplies by the scale cast to the activation dtype
        self.embd_scale = torch.tensor(spec.embd_scale, dtype=torch.float32)

    def layer_rope_tables(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s (cos, sin) tables on the device it runs on: a copy per other device, made on first use,
        where a placement splits the layers between devices (backends/split.py)."""
        tables, device = self.rope_tables[self.layer_rope[i]], self.layer_device(i)
        if tables[0].device == device:
            return tables
        moved = self.__dict__.setdefault("_tables_on", {})
        key = (self.layer_rope[i], device)
        if key not in moved:
            moved[key] = tuple(t.to(device) for t in tables)
        return moved[key]

    @staticmethod
    def arrange_weights(cfg, weights: dict) -> dict:
        """The file's tensors as the forward names them (Phi-3's fused ones split, a shared-expert gate stored as a
        [1, n_embd] matrix as the vector it is); others as they are."""
        spec = ArchSpec.from_config(cfg)
        if spec.ffn_norm_tensor != "ffn_norm":
            weights = {n.replace(f".{spec.ffn_norm_tensor}.", ".ffn_norm.") if n.startswith("blk.") else n: t
                       for n, t in weights.items()}
        if spec.shexp_gate:
            weights = dict(weights)
            for i in range(cfg.n_layer):
                name = f"blk.{i}.ffn_gate_inp_shexp.weight"
                t = weights.get(name)
                if t is not None and len(t.shape) == 2 and t.shape[0] == 1:
                    weights[name] = QTensor(t.qtype, (t.shape[1],), t.data.reshape(-1), name)
        return split_fused(cfg, weights) if spec.fused_qkv else weights

    def moe(self, h: torch.Tensor, p: str) -> torch.Tensor:
        """The mixture-of-experts MLP of the layer named ``p`` ("blk.N.") on h [T, D] (ArchSpec says what it is):
        the router's softmax in float32, its top k (renormalised when norm_top_k), the selected experts' SwiGLU
        weighted and summed, plus the shared expert (sigmoid-gated where the family gates it)."""
        spec, w, vec = self.spec, self.w, self.vec
        logits = self.linear(h, w[p + "ffn_gate_inp.weight"])
        if spec.expert_bias:
            logits = logits + vec[p + "ffn_gate_inp.bias"]
        if spec.expert_gating == "softmax_weight":
            top, ids = torch.topk(logits, spec.n_expert_used, dim=-1)
            top = torch.softmax(top, dim=-1)
        else:
            top, ids = torch.topk(torch.softmax(logits, dim=-1), spec.n_expert_used, dim=-1)  # [T, k]
        if spec.norm_top_k:
            top = top / top.sum(-1, keepdim=True)
        g, u = self.experts(h, [w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"]], ids)
        if spec.expert_bias:
            g, u = g + self.expert_bias[p + "ffn_gate_exps.bias"][ids], u + self.expert_bias[p + "ffn_up_exps.bias"][ids]
        a = swiglu_oai(g, u, spec.swiglu_alpha, spec.swiglu_limit) if spec.act == "swiglu_oai" else self.glu(g, u)
        (d,) = self.experts(a, [w[p + "ffn_down_exps.weight"]], ids)  # [T, k, D]
        if spec.expert_bias:
            d = d + self.expert_bias[p + "ffn_down_exps.bias"][ids]
        m = (d * top.unsqueeze(-1)).sum(1)
        if spec.n_ff_shexp:
            s = self.linear(self.glu(self.linear(h, w[p + "ffn_gate_shexp.weight"]),
                                     self.linear(h, w[p + "ffn_up_shexp.weight"])), w[p + "ffn_down_shexp.weight"])
            if spec.shexp_gate:
                s = s * torch.sigmoid(h @ vec[p + "ffn_gate_inp_shexp.weight"]).unsqueeze(-1)
            m = m + s
        return m

    def forward(self, tokens: torch.Tensor, start_pos: int, kv, all_logits: bool = False) -> torch.Tensor:
        """tokens: [T] int64 at positions start_pos.. ; kv: KVCache. Returns logits [T or 1, n_vocab] f32 on the
        CPU: one token through the fused step where it applies, else forward_on_device."""
        if tokens.shape[0] == 1:  # the fused step where it applies (fused_logits says None where not)
            fused = self.fused_logits(int(tokens[0]), start_pos, kv)
            if fused is not None:
                return fused[0].view(1, -1)
        return self.to_cpu(self.forward_on_device(tokens, start_pos, kv, all_logits))

    def forward_on_device(self, tokens: torch.Tensor, start_pos: int | torch.Tensor, kv,
                     all_logits: bool = False) -> torch.Tensor:
        """The forward itself: logits [T or 1, n_vocab] f32 on the device of the output head, never the fused step.

        ``start_pos`` is an int, or a device-held int64 [1] tensor: then nothing here reads a value back to the host
        (no Python integer changes between calls), so a CUDA graph captures it once and replays it at every position
        (backends/cuda_step.py).  That form writes the new rows at those positions and attends over the whole cache,
        masked by position (or the backend's kernel, Decoder.attend_at); it takes a cache whose means are fixed and
        tokens already checked against the vocabulary (no range check: that would read back)."""
        spec, w, vec, lin, eps = self.spec, self.w, self.vec, self.linear, self.spec.rms_eps
        H, Hkv, hd = spec.n_head, spec.n_kv_head, spec.head_dim
        t = tokens.shape[0]
        held = isinstance(start_pos, torch.Tensor)  # positions held on the device
        if held:
            x = self.embed(w["token_embd.weight"], tokens, check_ids=False)  # [T, D]
        else:
            x = self.embed(w["token_embd.weight"], tokens)
        if spec.embd_scale:
            x = x * self.embd_scale
        sl = start_pos + torch.arange(t, device=start_pos.device) if held else slice(start_pos, start_pos + t)
        for i, layer in enumerate(spec.layers):
            x = self.enter_layer(i, x)
            p = f"blk.{i}."
            h = self.norm(x, vec[p + "attn_norm.weight"], eps)
            q = lin(h, w[p + "attn_q.weight"])
            k = lin(h, w[p + "attn_k.weight"])
            v = lin(h, w[p + "attn_v.weight"])
            if spec.qkv_bias:
                q = q + vec[p + "attn_q.bias"]
                k = k + vec[p + "attn_k.bias"]
                v = v + vec[p + "attn_v.bias"]
            q, k, v = q.view(t, H, hd), k.view(t, Hkv, hd), v.view(t, Hkv, hd)
            if spec.qk_norm:
                q = self.norm(q, vec[p + "attn_q_norm.weight"], eps)
                k = self.norm(k, vec[p + "attn_k_norm.weight"], eps)
            if layer.rope:
                cos, sin = self.layer_rope_tables(i)
                if held:
                    cos, sin = cos.index_select(0, sl), sin.index_select(0, sl)
                else:
                    cos, sin = cos[sl], sin[sl]
                q = self.rope(q, cos, sin, spec.rope_style, spec.rope_dim)
                k = self.rope(k, cos, sin, spec.rope_style, spec.rope_dim)
            kv.update(i, start_pos, k, v, q=q)
            if spec.attn_sinks:
                if held:  # the sink softmax reads the cache up to a host position
                    raise ValueError("attention sinks take a host position: this forward is not captured for them")
                # in the model's basis: a sink logit is not shifted with the scores, so the storage basis of a
                # centered cache (which relies on softmax ignoring a per-query shift) would not give these weights
                sinks = vec[p + "attn_sinks.weight"]
                if start_pos == 0:
                    a = sink_attention(q, k.transpose(0, 1), v.transpose(0, 1), 0, spec.attn_scale, layer.window, sinks)
                else:
                    upto = start_pos + t
                    a = sink_attention(q, kv.k_part.view(i, upto).float(), kv.v_part.view(i, upto).float(), start_pos,
                                       spec.attn_scale, layer.window, sinks)
            elif held:
                a = self.attend_at(kv, i, q, start_pos, spec.attn_scale, layer.window, attention)
            elif start_pos == 0:
                # A fresh prompt's first FRESH_ROWS rows attend to their own float32 keys, not to their rounded
                # cache copies; the rows after them through the cache, as every later chunk does, so that a row
                # has the same bits however the prompt was cut into forwards (runtime/batch.py reads prompts in
                # spans).
                f = min(t, FRESH_ROWS)
                a = self.causal_attention(q[:f], k[:f], v[:f], spec.attn_scale, layer.window, attention)
                if t > f:
                    rest = kv.attend(i, q[f:], f, self.cache_attention(spec.attn_scale, layer.window, attention))
                    a = torch.cat([a, rest])
            else:
                # The cache runs attention over its own storage (a rotated cache attends in its rotated basis).
                a = kv.attend(i, q, start_pos, self.cache_attention(spec.attn_scale, layer.window, attention))
            a = lin(a, w[p + "attn_output.weight"])
            if spec.attn_out_bias:
                a = a + vec[p + "attn_output.bias"]
            x = x + (self.norm(a, vec[p + "post_attention_norm.weight"], eps) if spec.post_norms else a)
            h = self.norm(x, vec[p + "ffn_norm.weight"], eps)
            if spec.n_expert:
                m = self.moe(h, p)
            else:
                g = lin(h, w[p + "ffn_gate.weight"])
                u = lin(h, w[p + "ffn_up.weight"])
                m = lin(self.glu(g, u, gelu_tanh=spec.act == "gelu_tanh"), w[p + "ffn_down.weight"])
            x = x + (self.norm(m, vec[p + "post_ffw_norm.weight"], eps) if spec.post_norms else m)
        if not all_logits:
            x = x[-1:]
        x = self.enter_layer(spec.n_layer, x)
        x = self.norm(x, vec["output_norm.weight"], eps)
        if all_logits and x.shape[0] > 1:
            # The last row through the head alone, as a forward without all_logits takes it: over many rows the head
            # is a GEMM, which sums in another order than the one-row GEMV, and a prompt scored with every row's
            # logits (echo with logprobs) must go on as the same prompt read plainly does.
            logits = torch.cat([self.output_linear(x[:-1], self.output), self.output_linear(x[-1:], self.output)])
        else:
            logits = self.output_linear(x, self.output)
        if spec.final_softcap:
            logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
        return logits
