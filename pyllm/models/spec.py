"""ArchSpec: what a decoder layer is, for every architecture pyllm runs, as one typed, frozen value.

The torch forward (models/transformer.py), the C++ decode step (csrc/cpu/decode_step.cpp, through the
``DecodeArch`` struct bound in csrc/bindings_decode_context.cpp) and the CUDA step (backends/cuda_step.py) all read
this one description; none of them branches on an architecture name.  A family is added here (one ``_family``
entry), in the converter's tensor mapping, and nowhere else.

The spec is derived from a ModelConfig (itself read from GGUF metadata or an AWQ folder's config.json, and checked
there) and validated once, in ``__post_init__``: a value no body can run fails at load with a ModelError naming
the field.  Embedding encoders (the BERT family) are another body, described by models/encoder_spec.py's EncoderSpec.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field, replace

from ..errors import ModelError
from .config import ModelConfig

ROPE_STYLES = ("norm", "neox")  # adjacent pairs (llama-converted Q/K rows) / the two halves of each head
# the MLP gate's activation: SiLU (llama), tanh-approximated GELU (Gemma), or gpt-oss's clamped SwiGLU
# (swiglu_oai: g = min(g, limit), u = clamp(u, -limit, limit), g * sigmoid(alpha * g) * (u + 1))
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
# How the router's logits weigh the experts: "softmax" over all experts, then the top k (Qwen-MoE); "softmax_weight"
# the top k logits, then a softmax over those (gpt-oss; llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT)
EXPERT_GATINGS = ("softmax", "softmax_weight")
# Where a family's file keeps the FFN's pre-norm: llama.cpp names gpt-oss's "post_attention_norm"
FFN_NORM_TENSORS = ("ffn_norm", "post_attention_norm")


@dataclass(frozen=True)
class YarnSpec:
    """YaRN rope scaling (transformers' _compute_yarn_parameters; ggml's rope_yarn): each frequency blends its
    interpolated (divided by ``factor``) and original value by a linear ramp over the dimensions between the
    correction dims of ``beta_fast`` and ``beta_slow`` rotations in ``orig_ctx`` positions (floored / ceiled when
    ``truncate``), and cos / sin are multiplied by 0.1 ln(factor) + 1."""

    factor: float
    orig_ctx: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = False


@dataclass(frozen=True)
class LayerSpec:
    """What differs between the layers of one model: their rotary embedding and their attention span."""

    rope_base: float = 10000.0
    rope_scale: float = 1.0  # linear position scaling: positions are divided by it (1: none)
    window: int = 0  # sliding-window attention: each query sees its last ``window`` keys (0: every key)
    rope: bool = True  # False: q and k are not rotated in this layer (NoPE: positions reach it through the mask)


@dataclass(frozen=True)
class ArchSpec:
    """One architecture's decoder, layer by layer: every body (torch, C++ step, CUDA step) computes, per layer,

        h = norm(x) ; q, k, v = h Wq (+ bq), h Wk (+ bk), h Wv (+ bv) ; q, k = qk_norm(q, k)
        q, k = rope(q, k) where the layer has rope
        a = attention(q, K, V, attn_scale, window) Wo ; x += post_attention_norm(a) if post_norms else a
        h = norm(x) ; m = (act(h Wgate) * h Wup) Wdown ; x += post_ffw_norm(m) if post_norms else m

    (with attn_out_bias, a gets bo after Wo; with attn_sinks, each head's softmax has one more logit, its sink, in
    its denominator: p_j = exp(s_j) / (sum_i exp(s_i) + exp(sink_h)))

    with x = embedding * embd_scale (0: none) first and logits = softcap(norm(x) Woutput) last.

    A mixture-of-experts layer (n_expert > 0) replaces the MLP: p = softmax(h Wrouter) ; the n_expert_used largest
    p_e (renormalised to sum 1 when norm_top_k) weigh the selected experts' MLPs, m = sum_e p_e (silu(h Wgate_e) *
    h Wup_e) Wdown_e ; plus, where n_ff_shexp > 0, a shared expert's MLP, scaled by sigmoid(h . w_shexp_gate) when
    shexp_gate.  The experts' matrices are stacked: ffn_{gate,up,down}_exps [n_expert, rows, cols].  With
    expert_gating "softmax_weight" the top k are taken of the logits and p is their softmax; with expert_bias the
    router and every expert matrix have a bias (ffn_gate_inp.bias, ffn_{gate,up,down}_exps.bias [n_expert, rows]),
    and act (swiglu_oai) replaces silu(g) * u."""

    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_vocab: int
    rope_dim: int
    rope_style: str = "norm"
    rms_eps: float = 1e-5
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False  # Gemma: each block's output is normed before the residual add
    act: str = "silu"
    embd_scale: float = 0.0  # float32-representable: the bodies multiply by it in float32 (0: none)
    final_softcap: float = 0.0  # logits = tanh(logits / c) * c (0: none)
    attn_scale: float = 0.0  # the queries' scale; 0 here means head_dim ** -0.5 (set in __post_init__)
    tied_output: bool = False  # the output projection is the token embedding
    rope_freq_factors: bool = False  # llama3 rope scaling: the file's rope_freqs divide the frequencies
    fused_qkv: bool = False  # the file keeps attn_qkv ([q; k; v] rows) and ffn_up ([gate; up]) fused (Phi-3)
    n_expert: int = 0  # mixture of experts: experts per layer (0: a dense MLP)
    n_expert_used: int = 0  # experts each token is routed to (the router's top k)
    n_ff_exp: int = 0  # each expert's hidden size
    n_ff_shexp: int = 0  # the shared expert's hidden size (0: none)
    shexp_gate: bool = False  # the shared expert's output is scaled by sigmoid(h . ffn_gate_inp_shexp)
    norm_top_k: bool = False  # the selected experts' weights are renormalised to sum to 1
    expert_gating: str = "softmax"  # one of EXPERT_GATINGS
    expert_bias: bool = False  # the router and the experts' matrices have biases
    swiglu_alpha: float = 1.702  # act swiglu_oai's constants (llama.cpp and transformers hard-code these values)
    swiglu_limit: float = 7.0
    attn_sinks: bool = False  # attn_sinks.weight [n_head]: a learned logit per head in each softmax's denominator
    attn_out_bias: bool = False  # attn_output.bias
    ffn_norm_tensor: str = "ffn_norm"  # the file's name of the FFN pre-norm (renamed to ffn_norm at load)
    yarn: YarnSpec | None = None  # YaRN-scaled rope tables (every rotating layer)
    layers: tuple[LayerSpec, ...] = field(default=())

    def __post_init__(self):
        def bad(name, value, want):
            raise ModelError(f"{self.arch}: architecture field {name} = {value!r} {want}")

        for name in ("n_layer", "n_embd", "n_ff", "n_head", "n_kv_head", "head_dim", "n_vocab", "rope_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < (1 << 31):
                bad(name, v, "is not an integer in [1, 2**31)")
        if self.n_head % self.n_kv_head:
            bad("n_kv_head", self.n_kv_head, f"does not divide n_head {self.n_head}")
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            bad("rope_dim", self.rope_dim, f"is not even and <= head_dim {self.head_dim}")
        if self.rope_style not in ROPE_STYLES:
            bad("rope_style", self.rope_style, f"is not one of {', '.join(ROPE_STYLES)}")
        for name, allowed in (("act", ACTIVATIONS), ("expert_gating", EXPERT_GATINGS),
                              ("ffn_norm_tensor", FFN_NORM_TENSORS)):
            if getattr(self, name) not in allowed:
                bad(name, getattr(self, name), f"is not one of {', '.join(allowed)}")
        for name in ("expert_bias", "attn_sinks", "attn_out_bias"):
            if not isinstance(getattr(self, name), bool):
                bad(name, getattr(self, name), "is not true or false")
        for name in ("swiglu_alpha", "swiglu_limit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                bad(name, v, "is not a finite number > 0")
        if self.ffn_norm_tensor != "ffn_norm" and self.post_norms:
            bad("ffn_norm_tensor", self.ffn_norm_tensor, "names a tensor the post norms (post_norms) use")
        y = self.yarn
        if y is not None and not (isinstance(y, YarnSpec) and all(
                not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                for v in (y.factor, y.beta_fast, y.beta_slow)) and y.factor >= 1 and isinstance(y.orig_ctx, int)
                and not isinstance(y.orig_ctx, bool) and 1 <= y.orig_ctx < (1 << 31) and isinstance(y.truncate, bool)):
            bad("yarn", y, "is not a YarnSpec with factor >= 1, betas > 0 and orig_ctx in [1, 2**31)")
        for name in ("rms_eps", "embd_scale", "final_softcap", "attn_scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or \
                    (name == "rms_eps" and v == 0):
                bad(name, v, "is not a finite number >= 0" + (" and > 0" if name == "rms_eps" else ""))
        if self.n_expert:
            for name, lo, hi in (("n_expert", 1, 1 << 16), ("n_expert_used", 1, self.n_expert), ("n_ff_exp", 1, 1 << 31),
                                 ("n_ff_shexp", 0, 1 << 31)):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                    bad(name, v, f"is not an integer in [{lo}, {hi}]")
            if self.shexp_gate and not self.n_ff_shexp:
                bad("shexp_gate", True, "needs a shared expert (n_ff_shexp > 0)")
        elif self.n_expert_used or self.n_ff_exp or self.n_ff_shexp or self.shexp_gate or self.expert_bias or \
                self.expert_gating != "softmax":
            bad("n_expert", self.n_expert, "is 0 (a dense MLP) but expert fields are set")
        elif self.act == "swiglu_oai":  # every body applies it to the routed experts' MLPs only
            bad("act", self.act, "needs a mixture of experts (n_expert > 0)")
        if self.attn_scale == 0:
            object.__setattr__(self, "attn_scale", 1.0 / math.sqrt(self.head_dim))
        if len(self.layers) != self.n_layer:
            bad("layers", f"<{len(self.layers)} entries>", f"does not have one entry per layer ({self.n_layer})")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerSpec):
                bad(f"layers[{i}]", layer, "is not a LayerSpec")
            if not (math.isfinite(layer.rope_base) and layer.rope_base > 0):
                bad(f"layers[{i}].rope_base", layer.rope_base, "is not a finite number > 0")
            if not (math.isfinite(layer.rope_scale) and layer.rope_scale > 0):
                bad(f"layers[{i}].rope_scale", layer.rope_scale, "is not a finite number > 0")
            if isinstance(layer.window, bool) or not isinstance(layer.window, int) or \
                    not 0 <= layer.window < (1 << 31):
                bad(f"layers[{i}].window", layer.window, "is not an integer in [0, 2**31)")
            if not isinstance(layer.rope, bool):
                bad(f"layers[{i}].rope", layer.rope, "is not true or false")

    def rope_keys(self) -> tuple[tuple[tuple[float, float], ...], tuple[int, ...]]:
        """(the distinct (rope_base, rope_scale) pairs in order of first use, each layer's index into them, -1 for
        a layer without rope): the rope tables a body builds once and the table each layer reads.  There is always
        one table, even where no layer rotates: the steps read the positions they hold from its length."""
        keys: list[tuple[float, float]] = []
        index = []
        for layer in self.layers:
            key = (layer.rope_base, layer.rope_scale)
            if layer.rope and key not in keys:
                keys.append(key)
            index.append(keys.index(key) if layer.rope else -1)
        return tuple(keys) or ((self.layers[0].rope_base, self.layers[0].rope_scale),), tuple(index)

    def fused_step_gaps(self, backend: str) -> tuple[str, ...]:
        """The fields set here that ``backend``'s fused one-token step ("cpu": the C++ step, csrc/cpu/decode_step.cpp;
        "cuda": the CUDA step, backends/cuda_step.py) does not compute: where any is, that backend gives no fused
        step and the torch forward runs every token.  The C++ step computes every field; the CUDA step lacks
        gpt-oss's (it also refuses any mixture of experts, cuda_step.fused_decode_problem)."""
        if backend == "cpu":
            return ()
        if backend != "cuda":
            raise ValueError(f"fused_step_gaps: backend must be 'cpu' or 'cuda', got {backend!r}")
        gaps = [n for n in ("attn_sinks", "attn_out_bias", "expert_bias") if getattr(self, n)]
        if self.act == "swiglu_oai":
            gaps.append("act")
        if self.expert_gating != "softmax":
            gaps.append("expert_gating")
        return tuple(gaps)

    def with_windows(self, window: int, where=None) -> "ArchSpec":
        """This spec with the window of every layer ``where(layer)`` holds (default: every layer) set to
        ``window`` (tests: a short window on a short prompt)."""
        return replace(self, layers=tuple(replace(la, window=window) if where is None or where(la) else la
                                          for la in self.layers))

    def layer_tensors(self) -> tuple[str, ...]:
        """The tensor names (without "blk.N.") every layer of this architecture must have."""
        names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"]
        if self.n_expert:
            names += ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
            if self.n_ff_shexp:
                names += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
            if self.shexp_gate:
                names.append("ffn_gate_inp_shexp")
        else:
            names += ["ffn_gate", "ffn_up", "ffn_down"]
        if self.attn_sinks:
            names.append("attn_sinks")
        if self.qk_norm:
            names += ["attn_q_norm", "attn_k_norm"]
        if self.post_norms:
            names += ["post_attention_norm", "post_ffw_norm"]
        out = [f"{n}.weight" for n in names]
        if self.qkv_bias:
            out += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
        if self.attn_out_bias:
            out.append("attn_output.bias")
        if self.expert_bias:
            out += ["ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias"]
        return tuple(out)

    @classmethod
    def from_config(cls, cfg: ModelConfig, tensor_names=None) -> "ArchSpec":
        """The spec of ``cfg``'s architecture (ModelError for one pyllm does not run, or a value it cannot).
        ``tensor_names``: the file's tensors, for what the file decides (llama3 rope factors)."""
        family = _FAMILIES.get(cfg.arch)
        if family is None:
            raise ModelError(f"unsupported architecture {cfg.arch!r} (general.architecture); supported: "
                             f"{', '.join(sorted(_FAMILIES))}")
        base = dict(arch=cfg.arch, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_ff=cfg.n_ff, n_head=cfg.n_head,
                    n_kv_head=cfg.n_kv_head, head_dim=cfg.head_dim, n_vocab=cfg.n_vocab,
                    rope_dim=cfg.rope_dim or cfg.head_dim, rope_style=cfg.rope_style, rms_eps=cfg.rms_eps,
                    qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm, tied_output=cfg.tied_output,
                    rope_freq_factors=tensor_names is not None and "rope_freqs.weight" in tensor_names)
        base.update(family(cfg))
        return cls(**base)


def _llama(cfg: ModelConfig) -> dict:
    """llama / SmolLM2, mistral, qwen2, qwen3, phi3: one rope table, one window (0 or the file's sliding_window)
    for every layer.  Phi-3 files keep q/k/v and gate/up fused, as its checkpoint does (split at load)."""
    return dict(layers=(LayerSpec(cfg.rope_base, 1.0, cfg.sliding_window),) * cfg.n_layer,
                fused_qkv=cfg.arch == "phi3")


def _gemma3(cfg: ModelConfig) -> dict:
    """Gemma 3, each difference checked against transformers' Gemma3ForCausalLM and llama.cpp's gemma3 graph:
    the embedding times sqrt(n_embd) (in float32; the tied output head is not scaled); RMSNorm x * (1 + w), whose
    (1 + w) llama.cpp's converter already stored; norms after both blocks as well as before; QK-norm; GeGLU with the
    tanh GELU; local layers attend to a sliding window with their own rope base (10000), every ``swa_pattern``-th
    layer ((i + 1) % pattern == 0) is global with rope.freq_base and the linear rope scaling if any; queries scaled
    by query_pre_attn_scalar ** -0.5; optional final logit soft-capping."""
    ex = cfg.extra
    if ex.get("attn_logit_softcapping"):
        raise ModelError(f"{cfg.arch}: attn_logit_softcapping = {ex['attn_logit_softcapping']!r}: attention logit "
                         f"soft-capping is not supported")
    pattern = int(ex.get("swa_pattern", 6))
    local = LayerSpec(float(ex.get("rope_local_base", 10000.0)), 1.0, int(cfg.sliding_window or 0))
    glob = LayerSpec(cfg.rope_base, float(ex.get("rope_scale", 1.0)), 0)
    # the float32 value of sqrt(n_embd): HF multiplies by it cast to the activation dtype
    embd_scale = struct.unpack("<f", struct.pack("<f", math.sqrt(cfg.n_embd)))[0]
    return dict(qk_norm=True, post_norms=True, act="gelu_tanh", embd_scale=embd_scale,
                final_softcap=float(ex.get("final_logit_softcapping", 0.0) or 0.0),
                attn_scale=float(ex.get("query_pre_attn_scalar", cfg.head_dim)) ** -0.5,
                layers=tuple(glob if pattern <= 0 or (i + 1) % pattern == 0 else local for i in range(cfg.n_layer)))


def _smollm3(cfg: ModelConfig) -> dict:
    """SmolLM3: llama's layers, except that every 4th ((i + 1) % 4 == 0) has no rotary embedding (NoPE), as
    transformers' default no_rope_layers and llama.cpp's smollm3 graph (n_no_rope_layer_step = 4, no metadata key)
    have it."""
    return dict(layers=tuple(LayerSpec(cfg.rope_base, 1.0, cfg.sliding_window, rope=(i + 1) % 4 != 0)
                             for i in range(cfg.n_layer)))


def _moe(cfg: ModelConfig) -> dict:
    """Qwen2-MoE and Qwen3-MoE (checked against transformers' Qwen2MoeForCausalLM / Qwen3MoeForCausalLM and
    llama.cpp's build_moe_ffn): the llama layer with the MLP replaced by softmax top-k routing over stacked experts;
    Qwen2-MoE adds a shared expert gated by a sigmoid, Qwen3-MoE has QK-norm and no shared expert.  Whether the
    top-k weights are renormalised: the file's expert_weights_norm, else the family's default (config.py)."""
    ex = cfg.extra
    for key, meta in (("expert_count", "expert_count"), ("expert_used_count", "expert_used_count"),
                      ("expert_ff", "expert_feed_forward_length")):
        if key not in ex:
            raise ModelError(f"{cfg.arch}: metadata key {cfg.arch}.{meta} is missing (a mixture-of-experts model)")
    return dict(layers=(LayerSpec(cfg.rope_base, 1.0, cfg.sliding_window),) * cfg.n_layer,
                n_expert=ex["expert_count"], n_expert_used=ex["expert_used_count"], n_ff_exp=ex["expert_ff"],
                n_ff_shexp=ex.get("expert_shared_ff", 0), shexp_gate=bool(ex.get("expert_shared_gate")),
                norm_top_k=bool(ex.get("expert_weights_norm")))


def _gpt_oss(cfg: ModelConfig) -> dict:
    """gpt-oss (checked against transformers' GptOssForCausalLM and llama.cpp's openai-moe graph): Qwen-MoE's
    layer with biases on q, k, v, the attention output, the router and every expert matrix; a learned sink logit
    per head in each attention softmax; softmax over the top k router logits (not top k of the softmax); the
    clamped SwiGLU (alpha 1.702, limit 7); sliding-window attention in the even layers (llama.cpp's swa pattern 2,
    transformers' layer_types), full attention in the odd ones; YaRN rope (truncate off, as gpt-oss's config has
    it); the FFN pre-norm kept as post_attention_norm in llama.cpp's files."""
    moe = _moe(cfg)
    y = cfg.extra.get("rope_yarn")
    return dict(moe, layers=tuple(LayerSpec(cfg.rope_base, 1.0, cfg.sliding_window if i % 2 == 0 else 0)
                                  for i in range(cfg.n_layer)),
                norm_top_k=False, expert_gating="softmax_weight", expert_bias=True, act="swiglu_oai",
                attn_sinks=True, attn_out_bias=True, ffn_norm_tensor="post_attention_norm",
                yarn=YarnSpec(y["factor"], y["orig_ctx"], y["beta_fast"], y["beta_slow"]) if y else None)


# general.architecture -> the family's entries (what differs from the ArchSpec defaults)
_FAMILIES = {"llama": _llama, "mistral": _llama, "qwen2": _llama, "qwen3": _llama, "phi3": _llama,
             "gemma3": _gemma3, "smollm3": _smollm3, "qwen2moe": _moe, "qwen3moe": _moe,
             "gpt-oss": _gpt_oss}
ARCHITECTURES = tuple(sorted(_FAMILIES))
