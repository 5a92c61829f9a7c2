"""The one torch forward, for every architecture: a decoder-only transformer whose layers ArchSpec describes
(models/spec.py).  No architecture name is read here; what differs between families is a spec entry (norm
placement, activation, rope tables per layer, windows, scales) or a weight adapter (``arrange_weights``).

Activations are float32 on the backend's device.  Weights stay quantized (QTensor) and go through the backend's
``linear`` on every use, so the kernels decide how they are read: the fused dequantize-in-GEMV for decode,
dequantize + matmul for prefill (pyllm/backends).  This forward is the reference the fused steps (the C++ step,
the CUDA step) are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ModelError
from ..formats.quant import QTensor
from .config import ModelConfig
from .decoder import Decoder
from .spec import ArchSpec


def rope_tables(cfg: ModelConfig, n_pos: int, base: float | None = None, freq_factors: torch.Tensor | None = None,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [n_pos, rope_dim/2] float32. freq_factors (llama3 rope_freqs) divide the frequencies; ``scale``
    (linear rope scaling) divides the positions."""
    base = cfg.rope_base if base is None else base
    half = cfg.rope_dim // 2
    inv = 1.0 / (base ** (torch.arange(0, half, dtype=torch.float64) * 2.0 / cfg.rope_dim))
    if freq_factors is not None:
        inv = inv / freq_factors.double()[:half]
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]
    ang = (pos if scale == 1.0 else pos / scale) * inv[None, :]
    return ang.cos().float(), ang.sin().float()


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
        self.rope_tables = [tuple(t.to(self.device) for t in rope_tables(cfg, max_pos, base, factors, scale))
                            for base, scale in keys]
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
        probs = torch.softmax(self.linear(h, w[p + "ffn_gate_inp.weight"]), dim=-1)
        top, ids = torch.topk(probs, spec.n_expert_used, dim=-1)  # [T, k]
        if spec.norm_top_k:
            top = top / top.sum(-1, keepdim=True)
        g, u = self.experts(h, [w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"]], ids)
        (d,) = self.experts(self.glu(g, u), [w[p + "ffn_down_exps.weight"]], ids)  # [T, k, D]
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
        (backends/cuda.py).  That form writes the new rows at those positions and attends over the whole cache,
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
            if held:
                a = self.attend_at(kv, i, q, start_pos, spec.attn_scale, layer.window, attention)
            elif start_pos == 0:
                # A fresh prompt attends to its own float32 keys, not to their rounded cache copies.
                a = self.causal_attention(q, k, v, spec.attn_scale, layer.window, attention)
            else:
                # The cache runs attention over its own storage (a rotated cache attends in its rotated basis).
                a = kv.attend(i, q, start_pos, self.cache_attention(spec.attn_scale, layer.window, attention))
            a = lin(a, w[p + "attn_output.weight"])
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
        logits = self.output_linear(x, self.output)
        if spec.final_softcap:
            logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
        return logits
