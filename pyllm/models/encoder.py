"""Embedding encoders of the BERT family (``bert``, ``nomic-bert``): a bidirectional transformer whose hidden states
are pooled into one vector per text (pyllm/embed.py pools and normalises them).

EncoderSpec describes one, as ArchSpec describes a decoder (models/spec.py): derived from the file's ModelConfig,
validated once, each bad value a ModelError naming its field.  Each difference from a decoder was checked against
transformers' BertModel / NomicBertModel and llama.cpp's bert graph (llm_build_bert), whose GGUF names these files
use:

    x = token_embd[ids] + token_types[0] (+ position_embd[pos]: absolute positions) ; x = LayerNorm(x) (token_embd_norm)
    per layer:  q, k, v = x Wq (+ bq), x Wk (+ bk), x Wv (+ bv)  (or one attn_qkv) ; rotary positions: q, k = rope(q, k)
                x = LayerNorm(x + attention(q, k, v) Wo (+ bo))                     (attn_output_norm)
                m = gelu(x Wup + bup) Wdown + bdown  (bert)  |  (silu(x Wgate) * x Wup) Wdown  (nomic-bert)
                x = LayerNorm(x + m)                                                 (layer_output_norm)

Every token attends to every token (no causal mask, no KV cache: a text is encoded in one pass).  Token types are
all "sentence A" (row 0), as llama.cpp and sentence-transformers embed one text.  BERT's GELU is the exact (erf)
one transformers runs (llama.cpp's ggml_gelu is the tanh approximation; the two differ by < 1e-3 per value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ModelError
from .config import ModelConfig
from .decoder import apply_rope

POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}  # {arch}.pooling_type: llama.cpp's enum (0 none, 4 rank)
POOLINGS = tuple(POOLING_TYPES.values())
POSITIONS = ("absolute", "rope")  # a learned table (position_embd) / rotary, on the two halves of each head
FFNS = ("gelu", "swiglu")  # gelu(up) then down, with biases / silu(gate) * up then down


@dataclass(frozen=True)
class EncoderSpec:
    """One encoder, as every body computes it (see the module docstring).  ``kind`` tells it from a decoder's
    ArchSpec; ``pooling`` and ``normalize`` are how its hidden states become the text's vector; ``matryoshka``:
    a prefix of that vector is itself an embedding (trained so: nomic-embed-text v1.5), so a request may truncate
    it (then it is normalised again)."""

    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    head_dim: int
    n_vocab: int
    n_pos: int  # the longest text in tokens: the position table's rows (absolute) or the trained context (rope)
    positions: str = "absolute"
    rope_base: float = 10000.0
    ffn: str = "gelu"
    biases: bool = True  # every projection has a bias (bert); none has (nomic-bert)
    norm_eps: float = 1e-12
    pooling: str = "mean"
    normalize: bool = True
    matryoshka: bool = False
    kind: str = "encoder"

    def __post_init__(self):
        def bad(name, value, want):
            raise ModelError(f"{self.arch}: encoder field {name} = {value!r} {want}")

        for name in ("n_layer", "n_embd", "n_ff", "n_head", "head_dim", "n_vocab", "n_pos"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < (1 << 31):
                bad(name, v, "is not an integer in [1, 2**31)")
        if self.n_head * self.head_dim != self.n_embd:
            bad("head_dim", self.head_dim, f"times n_head {self.n_head} is not n_embd {self.n_embd}")
        if self.positions == "rope" and self.head_dim % 2:
            bad("head_dim", self.head_dim, "is odd: rotary positions turn pairs of values")
        for name, allowed in (("positions", POSITIONS), ("ffn", FFNS), ("pooling", POOLINGS)):
            if getattr(self, name) not in allowed:
                bad(name, getattr(self, name), f"is not one of {', '.join(allowed)}")
        for name in ("rope_base", "norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                bad(name, v, "is not a finite number > 0")
        for name in ("biases", "normalize", "matryoshka"):
            if not isinstance(getattr(self, name), bool):
                bad(name, getattr(self, name), "is not true or false")
        if self.kind != "encoder":
            bad("kind", self.kind, "is not 'encoder'")

    def tensor_shapes(self, fused_qkv: bool = False, n_types: int | None = None) -> dict[str, tuple[int, ...]]:
        """Every tensor this encoder reads, by GGUF name, with its shape ([rows, cols] = [out, in]).
        ``fused_qkv``: the file keeps attn_qkv ([q; k; v] rows) instead of the three; ``n_types``: the rows of its
        token_types table, where it has one."""
        d, ff = self.n_embd, self.n_ff
        out = {"token_embd.weight": (self.n_vocab, d), "token_embd_norm.weight": (d,), "token_embd_norm.bias": (d,)}
        if n_types is not None:
            out["token_types.weight"] = (n_types, d)
        if self.positions == "absolute":
            out["position_embd.weight"] = (self.n_pos, d)
        layer = {"attn_output.weight": (d, d), "attn_output_norm.weight": (d,), "attn_output_norm.bias": (d,),
                 "ffn_up.weight": (ff, d), "ffn_down.weight": (d, ff), "layer_output_norm.weight": (d,),
                 "layer_output_norm.bias": (d,)}
        layer.update({"attn_qkv.weight": (3 * d, d)} if fused_qkv else
                     {f"attn_{x}.weight": (d, d) for x in "qkv"})
        if self.ffn == "swiglu":
            layer["ffn_gate.weight"] = (ff, d)
        if self.biases:
            layer.update({"attn_output.bias": (d,), "ffn_up.bias": (ff,), "ffn_down.bias": (d,)})
            layer.update({"attn_qkv.bias": (3 * d,)} if fused_qkv else {f"attn_{x}.bias": (d,) for x in "qkv"})
        for i in range(self.n_layer):
            out.update((f"blk.{i}.{n}", s) for n, s in layer.items())
        return out

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "EncoderSpec":
        family = _FAMILIES.get(cfg.arch)
        if family is None:
            raise ModelError(f"{cfg.arch!r} is not an encoder architecture (encoders: {', '.join(ENCODERS)})")
        ex = cfg.extra
        if ex.get("causal"):
            raise ModelError(f"{cfg.arch}: {cfg.arch}.attention.causal = true: a causal encoder is not supported")
        ptype = ex.get("pooling_type", 1)
        if ptype not in POOLING_TYPES:
            raise ModelError(f"{cfg.arch}: {cfg.arch}.pooling_type = {ptype!r} is not an embedding pooling pyllm "
                             f"runs (1 mean, 2 cls, 3 last)")
        if cfg.n_kv_head != cfg.n_head:
            raise ModelError(f"{cfg.arch}: attention.head_count_kv = {cfg.n_kv_head} differs from head_count "
                             f"{cfg.n_head}; an encoder's attention has one key head per query head")
        return cls(arch=cfg.arch, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_ff=cfg.n_ff, n_head=cfg.n_head,
                   head_dim=cfg.head_dim, n_vocab=cfg.n_vocab, n_pos=cfg.n_ctx_train, rope_base=cfg.rope_base,
                   norm_eps=ex.get("layer_norm_eps", 1e-12), pooling=POOLING_TYPES[ptype], **family(cfg))


def _bert(cfg: ModelConfig) -> dict:
    """BERT (and all-MiniLM, bge, e5 ...): learned absolute positions, biases everywhere, GELU feed-forward."""
    return dict(positions="absolute", ffn="gelu", biases=True)


def _nomic_bert(cfg: ModelConfig) -> dict:
    """nomic-embed-text: rotary positions (NeoX halves, base rope.freq_base, 1000 in its files), no biases, a
    SwiGLU feed-forward (silu(fc12 x) * fc11 x); v1.5 was trained for Matryoshka truncation."""
    return dict(positions="rope", ffn="swiglu", biases=False, matryoshka=True)


_FAMILIES = {"bert": _bert, "nomic-bert": _nomic_bert}
ENCODERS = tuple(sorted(_FAMILIES))


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


class Encoder:
    """The encoder body over ``weights`` (GGUF names -> QTensors, still quantized), run by ``backend``: every
    matrix goes through ``backend.linear``, the embedding tables through ``backend.embed``."""

    is_encoder = True

    def __init__(self, cfg: ModelConfig, weights: dict, backend, max_pos: int):
        self.check_weights(cfg, weights)
        self.cfg = cfg
        self.spec = spec = EncoderSpec.from_config(cfg)
        self.backend = backend
        self.linear = backend.linear
        self.embed = backend.embed
        self.device = backend.device
        self.w = weights
        self.vec = {n: t.dequantize().reshape(-1).to(self.device) for n, t in weights.items() if len(t.shape) == 1}
        types = weights.get("token_types.weight")
        # every text is "sentence A": one row, added to every position
        self.type_row = None if types is None else self.embed(types, torch.zeros(1, dtype=torch.int64,
                                                                                  device=self.device))
        # BERT's position table has no row past n_pos; rotary positions were trained up to it
        self.max_pos = min(max_pos, spec.n_pos)
        if spec.positions == "rope":
            half = spec.head_dim // 2
            inv = 1.0 / (spec.rope_base ** (torch.arange(0, half, dtype=torch.float64) * 2.0 / spec.head_dim))
            ang = torch.arange(self.max_pos, dtype=torch.float64)[:, None] * inv[None, :]
            self.cos, self.sin = ang.cos().float().to(self.device), ang.sin().float().to(self.device)

    @staticmethod
    def check_weights(cfg: ModelConfig, weights: dict) -> None:
        """ModelError naming the first tensor the encoder needs that the file lacks, or whose shape contradicts
        the metadata."""
        spec = EncoderSpec.from_config(cfg)
        types = weights.get("token_types.weight")
        n_types = types.shape[0] if types is not None and len(types.shape) == 2 else None
        if n_types == 0:
            raise ModelError(f"{cfg.arch} tensor 'token_types.weight' has no rows; every text is of type 0")
        want = spec.tensor_shapes("blk.0.attn_qkv.weight" in weights, n_types)
        for name, shape in want.items():
            t = weights.get(name)
            if t is None:
                raise ModelError(f"{cfg.arch} model is missing tensor {name}")
            if tuple(t.shape) != shape:
                raise ModelError(f"{cfg.arch} tensor {name!r} has shape {tuple(t.shape)}, but the metadata (n_embd "
                                 f"{spec.n_embd}, heads {spec.n_head}, n_ff {spec.n_ff}, context {spec.n_pos}, "
                                 f"vocabulary {spec.n_vocab}) needs {shape}")

    @staticmethod
    def arrange_weights(cfg: ModelConfig, weights: dict) -> dict:
        """The file's tensors as the forward names them: a fused attn_qkv split into attn_q/k/v (zero-copy row
        slices: the weights stay quantized), its bias likewise."""
        from ..formats.quant import QTensor

        if "blk.0.attn_qkv.weight" not in weights:
            return weights
        Encoder.check_weights(cfg, weights)
        w, d = dict(weights), cfg.n_embd
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            for suffix in ("weight", "bias"):
                fused = w.pop(f"{p}attn_qkv.{suffix}", None)
                if fused is None:
                    continue
                per = fused.data.shape[0] // 3  # rows of a matrix; bytes of a vector's data
                for j, x in enumerate("qkv"):
                    name = f"{p}attn_{x}.{suffix}"
                    w[name] = QTensor(fused.qtype, (d, *fused.shape[1:]), fused.data[j * per:(j + 1) * per], name)
        return w

    def project(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = self.linear(x, self.w[name + ".weight"])
        return y + self.vec[name + ".bias"] if self.spec.biases else y

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: int64 [T] (T <= max_pos) -> the last layer's hidden states, float32 [T, n_embd]."""
        spec, vec, eps = self.spec, self.vec, self.spec.norm_eps
        t, H, hd = ids.shape[0], spec.n_head, spec.head_dim
        if not 1 <= t <= self.max_pos:
            raise ModelError(f"{spec.arch}: a text of {t} tokens; this encoder takes 1 to {self.max_pos}")
        ids = ids.to(self.device)
        x = self.embed(self.w["token_embd.weight"], ids)
        if self.type_row is not None:
            x = x + self.type_row
        if spec.positions == "absolute":
            x = x + self.embed(self.w["position_embd.weight"], torch.arange(t, device=self.device))
        x = layer_norm(x, vec["token_embd_norm.weight"], vec["token_embd_norm.bias"], eps)
        for i in range(spec.n_layer):
            p = f"blk.{i}."
            q, k, v = (self.project(x, f"{p}attn_{n}").view(t, H, hd) for n in "qkv")
            if spec.positions == "rope":
                q = apply_rope(q, self.cos[:t], self.sin[:t], "neox", hd)
                k = apply_rope(k, self.cos[:t], self.sin[:t], "neox", hd)
            a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               scale=hd ** -0.5)  # no mask: every token sees every token
            a = self.project(a.transpose(0, 1).reshape(t, H * hd), p + "attn_output")
            x = layer_norm(x + a, vec[p + "attn_output_norm.weight"], vec[p + "attn_output_norm.bias"], eps)
            if spec.ffn == "swiglu":
                m = F.silu(self.project(x, p + "ffn_gate")) * self.project(x, p + "ffn_up")
            else:
                m = F.gelu(self.project(x, p + "ffn_up"))
            m = self.project(m, p + "ffn_down")
            x = layer_norm(x + m, vec[p + "layer_output_norm.weight"], vec[p + "layer_output_norm.bias"], eps)
        return x.float().cpu()

    def forward(self, tokens: torch.Tensor, start_pos: int, kv, all_logits: bool = False) -> torch.Tensor:
        """A decoder's forward, which an encoder has not: it has no output head to predict a token with.  Every
        generating path refuses an encoder before it gets here (LLM.check_generates); this keeps any other one
        from ending in an AttributeError."""
        raise ModelError(f"{self.spec.arch} is an embedding encoder: it has no output head to predict tokens with")

    def fused_logits(self, token: int, pos: int, kv) -> None:
        return None  # no fused step: the generator then calls forward, which refuses
