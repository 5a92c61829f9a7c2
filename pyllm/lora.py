"""LoRA adapters in llama.cpp's GGUF format, applied at run time without merging them into the weights.

The file (what llama.cpp's convert_lora_to_gguf.py writes, and what ``llama-cli --lora`` reads): general.type
"adapter", adapter.type "lora", adapter.lora.alpha (float), general.architecture the base model's; for each adapted
matrix W [N, K] of the base model (GGUF name, e.g. ``blk.3.attn_q.weight``) two tensors ``<name>.lora_a`` [rank, K]
and ``<name>.lora_b`` [N, rank] (torch order; GGUF's ne reversed), in any float type or Q8_0.  The token
embedding's pair is stored flipped (llama.cpp's build_inp_embd): lora_a [n_vocab, rank], lora_b [n_embd, rank].
Norm vectors (``*_norm.weight``, which mergekit-extract-lora adds) are skipped, as llama.cpp skips them.

Adapter i with scale s_i adds s_i * (alpha_i / rank_i) * B_i (A_i x) to W x (llama.cpp's rule: s_i alone where alpha
is 0).  Several adapters on one matrix are one low-rank term of their ranks stacked, the scales folded into B:
sum_i c_i B_i A_i x = [c_1 B_1 | c_2 B_2 ...] [A_1; A_2; ...] x.  That term is what every backend adds after its
matrix product (models/decoder.py Decoder.attach_lora; the CPU's C++ decode step: csrc/cpu/decode_step.cpp).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import ModelError, PyllmError

ALPHA_KEY = "adapter.lora.alpha"


class LoraError(PyllmError):
    """An adapter file that cannot apply to the loaded model; the message names the file and what is wrong."""


@dataclass
class LowRank:
    """The term added to one matrix's output: y += (x @ a.T) @ bt, a [R, K] and bt [R, N] float32 with the scales
    in bt.  The token embedding's term is looked up: rows ids of a ([n_vocab, R]) @ bt ([R, n_embd])."""

    a: torch.Tensor
    bt: torch.Tensor

    @property
    def rank(self) -> int:
        return self.bt.shape[0]

    def to(self, device) -> "LowRank":
        return LowRank(self.a.to(device), self.bt.to(device))


@dataclass
class LoraAdapter:
    path: Path
    scale: float
    alpha: float
    arch: str
    # base tensor name -> (A, B) float32 as stored (token_embd: A [n_vocab, r], B [n_embd, r]; else A [r, K], B [N, r])
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def factor(self, rank: int) -> float:
        """What this adapter's B is multiplied by for a pair of ``rank``."""
        return self.scale * self.alpha / rank if self.alpha else self.scale

    def describe(self) -> dict:
        return {"path": str(self.path), "scale": self.scale, "alpha": self.alpha, "tensors": len(self.pairs)}


def parse_spec(spec) -> list[tuple[str, float]]:
    """``pyllm.load(lora=...)``: a path, a (path, scale) pair, or a list of either -> [(path, scale)]."""
    if spec is None:
        return []
    items = [spec] if isinstance(spec, (str, os.PathLike, tuple)) else spec
    if not isinstance(items, list):
        raise PyllmError(f"lora must be a path, a (path, scale) pair or a list of them, got {type(spec).__name__}")
    out = []
    for item in items:
        path, scale = None, None
        if isinstance(item, (str, os.PathLike)):
            path, scale = item, 1.0
        elif isinstance(item, tuple) and len(item) == 2:
            path, scale = item
        ok_scale = isinstance(scale, (int, float)) and not isinstance(scale, bool) and abs(float(scale)) < float("inf")
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path) or not ok_scale:
            raise PyllmError(f"lora: each entry must be a path or a (path, finite scale) pair, got {item!r}")
        out.append((os.fspath(path), float(scale)))
    return out


def read_adapter(path: str | os.PathLike, scale: float = 1.0) -> LoraAdapter:
    """An adapter file's pairs as float32 tensors; LoraError (one line, naming the file and the key or tensor) for
    a file that is not a LoRA adapter in llama.cpp's format."""
    from .formats.gguf import open_gguf
    from .formats.quant import qtensor_from_gguf

    p = Path(path)
    if not p.is_file():
        raise LoraError(f"LoRA adapter {p}: no such file")
    gf = open_gguf(p)  # GGUFError (naming the file) for anything that is not a valid GGUF
    try:
        md = gf.metadata
        if md.get("general.type") != "adapter" or md.get("adapter.type") != "lora":
            raise LoraError(f"LoRA adapter {p.name}: not a LoRA adapter (general.type {md.get('general.type')!r}, "
                            f"adapter.type {md.get('adapter.type')!r}; expected 'adapter' and 'lora', as llama.cpp's "
                            f"convert_lora_to_gguf.py writes)")
        alpha = md.get(ALPHA_KEY)
        if alpha is None:
            raise LoraError(f"LoRA adapter {p.name}: metadata {ALPHA_KEY!r} is missing")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not abs(float(alpha)) < float("inf"):
            raise LoraError(f"LoRA adapter {p.name}: metadata {ALPHA_KEY!r} must be a finite number, got {alpha!r}")
        adapter = LoraAdapter(p, scale, float(alpha), str(md.get("general.architecture", "")))
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name in gf.tensors:
            base, dot, part = name.rpartition(".")
            if part in ("lora_a", "lora_b") and base:
                try:
                    t = qtensor_from_gguf(gf, name).dequantize(torch.float32)
                except ModelError as e:
                    raise LoraError(f"LoRA adapter {p.name}: {e}") from None
                if t.dim() != 2:
                    raise LoraError(f"LoRA adapter {p.name}: tensor {name!r} has shape {tuple(t.shape)}, expected 2-D")
                if not bool(torch.isfinite(t).all()):
                    raise LoraError(f"LoRA adapter {p.name}: tensor {name!r} holds NaN or Inf values")
                halves.setdefault(base, {})[part] = t
            elif not name.endswith("_norm.weight"):  # norms: skipped, as llama.cpp does
                raise LoraError(f"LoRA adapter {p.name}: tensor {name!r} is neither a .lora_a nor a .lora_b")
        for base, h in halves.items():
            if len(h) != 2:
                missing = "lora_b" if "lora_a" in h else "lora_a"
                raise LoraError(f"LoRA adapter {p.name}: tensor {base}.{missing} is missing (its pair has only one "
                                f"half)")
            adapter.pairs[base] = (h["lora_a"], h["lora_b"])
        if not adapter.pairs:
            raise LoraError(f"LoRA adapter {p.name}: holds no lora_a/lora_b tensors")
        return adapter
    finally:
        gf.close()


def check_adapter(adapter: LoraAdapter, arch: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """LoraError unless ``adapter`` fits a base model of ``arch`` whose tensors have ``shapes`` (the file's names,
    torch order): llama.cpp's checks, with the tensor and both shapes named."""
    name = adapter.path.name
    if adapter.arch != arch:
        raise LoraError(f"LoRA adapter {name}: made for architecture {adapter.arch!r}, but the model is {arch!r}")
    for base, (a, b) in adapter.pairs.items():
        shape = shapes.get(base)
        if shape is None:
            raise LoraError(f"LoRA adapter {name}: tensor {base!r} is not in the base model (a different base "
                            f"model?)")
        if len(shape) != 2:
            raise LoraError(f"LoRA adapter {name}: tensor {base!r} is not a matrix in the base model ({shape})")
        n, k = shape
        if base == "token_embd.weight":  # stored flipped: a [n_vocab, r], b [n_embd, r]
            ok = a.shape[0] == n and b.shape[0] == k and a.shape[1] == b.shape[1]
            want = f"lora_a [{n}, r] and lora_b [{k}, r]"
        else:
            ok = a.shape[1] == k and b.shape[0] == n and a.shape[0] == b.shape[1]
            want = f"lora_a [r, {k}] and lora_b [{n}, r]"
        if not ok:
            raise LoraError(f"LoRA adapter {name}: tensor {base!r} has lora_a {list(a.shape)} and lora_b "
                            f"{list(b.shape)}, but the base model's is {list(shape)} (expected {want}; a different "
                            f"base model?)")


def combine(adapters: list[LoraAdapter]) -> dict[str, LowRank]:
    """One LowRank term per adapted matrix (the file's names) over all ``adapters``: ranks stacked, each adapter's
    factor folded into its B."""
    parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for ad in adapters:
        for base, (a, b) in ad.pairs.items():
            if base == "token_embd.weight":  # a [n_vocab, r] -> the term's a [n_vocab, R] keeps its layout
                parts.setdefault(base, []).append((a, b.T * ad.factor(a.shape[1])))
            else:
                parts.setdefault(base, []).append((a, b.T * ad.factor(a.shape[0])))
    out = {}
    for base, ps in parts.items():
        dim = 1 if base == "token_embd.weight" else 0
        out[base] = LowRank(torch.cat([a for a, _ in ps], dim).contiguous(),
                            torch.cat([bt for _, bt in ps], 0).contiguous())
    return out


def split_fused_terms(cfg, terms: dict[str, LowRank]) -> dict[str, LowRank]:
    """Terms on Phi-3's fused matrices split as models/phi3.py splits the weights (attn_qkv -> q, k, v rows;
    ffn_up [gate; up] -> gate, up): the output rows of a low-rank term are bt's columns, A is shared."""
    out = dict(terms)
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        t = out.pop(p + "attn_qkv.weight", None)
        if t is not None:
            for n, (lo, hi) in (("attn_q", (0, q)), ("attn_k", (q, q + kv)), ("attn_v", (q + kv, q + 2 * kv))):
                out[p + n + ".weight"] = LowRank(t.a, t.bt[:, lo:hi].contiguous())
        t = out.get(p + "ffn_up.weight")
        if t is not None and t.bt.shape[1] == 2 * cfg.n_ff:
            out[p + "ffn_gate.weight"] = LowRank(t.a, t.bt[:, :cfg.n_ff].contiguous())
            out[p + "ffn_up.weight"] = LowRank(t.a, t.bt[:, cfg.n_ff:].contiguous())
    return out


def load_adapters(spec, cfg, weights: dict) -> tuple[list[LoraAdapter], dict[str, LowRank]]:
    """(the adapters, their combined terms by the model's tensor names) for ``pyllm.load(lora=spec)``, checked
    against the base model's file tensors ``weights`` (name -> QTensor)."""
    adapters = [read_adapter(path, scale) for path, scale in parse_spec(spec)]
    shapes = {n: tuple(w.shape) for n, w in weights.items()}
    for ad in adapters:
        check_adapter(ad, cfg.arch, shapes)
    return adapters, split_fused_terms(cfg, combine(adapters)) if adapters else {}
