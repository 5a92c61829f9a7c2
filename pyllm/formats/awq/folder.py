"""An AWQ folder as pyllm loads it: open_awq (info, config, weights), read_awq (the Checkpoint pyllm.load turns into
an LLM), folder_info (`pyllm info` of the folder)."""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import AWQError
from ..gguf import GGMLType
from ...models.config import ModelConfig
from ..quant import QTensor
from .config import config_from_hf, llama3_rope_factors, read_folder_json, read_quant_config
from .tokenizer import chat_template_source, tokenizer_from_hf
from .weights import load_weights


class AWQInfo:
    """What LLM keeps in place of an open GGUF file: path, metadata, a tensor table for `info`, close()."""

    class _T:
        def __init__(self, w):
            self.ggml_type = type("Q", (), {"name": getattr(w.qtype, "name", w.qtype)})()
            self.shape = tuple(w.shape)
            self.nbytes = w.nbytes

    def __init__(self, path: Path, hf: dict, quant: dict, weights: dict, template: str | None, tok_kind: str):
        self.path = path
        self.hf_config = hf
        self.quant = quant
        self.metadata = {"general.name": path.name, "general.architecture": hf.get("model_type"),
                         "tokenizer.ggml.model": "llama" if tok_kind == "spm" else "gpt2",
                         "tokenizer.chat_template": template or "",
                         "awq.group_size": quant["group_size"]}
        self.tensors = {n: self._T(w) for n, w in weights.items()}

    def get(self, key, default=None):
        return self.metadata.get(key, default)

    def close(self) -> None:
        pass  # the shard mappings go when the last tensor view does


def open_awq(path) -> tuple[AWQInfo, ModelConfig, dict]:
    """(info, config, weights) of an AWQ folder; raises AWQError (one line) for anything wrong with it."""
    root = Path(path)
    if not root.is_dir():
        raise AWQError(f"{root}: is not a folder (an AWQ checkpoint is a folder with config.json)")
    hf = read_folder_json(root / "config.json")
    quant = read_quant_config(root, hf)
    weights = load_weights(root, quant["group_size"])
    source = str(root / "config.json")
    cfg = config_from_hf(hf, source, set(weights))
    if "llama3_rope" in cfg.extra:
        ff = llama3_rope_factors(cfg, cfg.extra.pop("llama3_rope"))
        weights["rope_freqs.weight"] = QTensor(GGMLType.F32, tuple(ff.shape), ff.view(torch.uint8), "rope_freqs")
    bad = cfg.shape_mismatch(weights)  # the GGUF loader's rule, worded for the folder
    if bad is not None:
        name, got, want = bad
        raise AWQError(f"{root}: {name} has shape {got} but config.json implies {want}")
    template = chat_template_source(root)
    info = AWQInfo(root, hf, quant, weights, template, "bpe")
    return info, cfg, weights


def read_awq(path, quiet: bool = True):
    """An AWQ folder as a Checkpoint (pyllm/formats/checkpoint.py): what pyllm.load turns into the same LLM and the same
    decoder as a GGUF file. Its int4 tensors stay in checkpoint form here; the backend lays them out."""
    import sys

    from ...chat_template import ChatTemplate
    from ..checkpoint import Checkpoint
    from ...models import model_class

    info, cfg, weights = open_awq(path)
    model_class(cfg)
    tok = tokenizer_from_hf(info.path, cfg.n_vocab)
    info.metadata["tokenizer.ggml.model"] = "llama" if tok.kind == "spm" else "gpt2"
    md = {"tokenizer.chat_template": info.metadata["tokenizer.chat_template"] or None}
    template = ChatTemplate.from_metadata(md, tok)
    if not quiet:
        print(f"AWQ: {info.path} (group size {info.quant['group_size']}, {cfg.arch}, {cfg.n_layer} layers)",
              file=sys.stderr)
    return Checkpoint(info.path, info, cfg, weights, tok, template)


def folder_info(path, n_ctx: int | None = None, kv_kind: str = "f16") -> dict:
    """`pyllm info DIR` for an AWQ folder: the GGUF info dict, from config.json and the shard headers only."""
    from ...info import model_info

    info, cfg, _ = open_awq(path)
    out = model_info(info, cfg, n_ctx=n_ctx, kv_kind=kv_kind)
    out["file_bytes"] = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
    out["quantization"] = f"AWQ gemm, 4-bit, group size {info.quant['group_size']}"
    tj = Path(path) / "tokenizer.json"
    out["tokenizer"] = "tokenizer.json" if tj.is_file() else "missing (tokenizer.json)"
    return out
