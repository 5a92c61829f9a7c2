"""EncoderSpec: one embedding encoder of the BERT family (``bert``, ``nomic-bert``) as its body computes it
(models/encoder.py), derived from the file's ModelConfig and validated once, each bad value a ModelError naming its
field -- as ArchSpec describes a decoder (models/spec.py).  Plain data without torch, so a model is described from
its header (`pyllm info`) without loading the body."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ModelError
from .config import ModelConfig

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
