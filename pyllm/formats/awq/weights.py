"""The folder's tensors under GGUF names: Hugging Face module names mapped to the decoder's, quantized linears as
AWQTensor, everything else as float QTensors (zero-copy views of the shards)."""

from __future__ import annotations

import re
from pathlib import Path

from ...errors import AWQError
from ..gguf import GGMLType
from ..quant import QTensor
from .shards import open_shards
from .unpack import AWQTensor

_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def gguf_module_name(hf_module: str) -> str | None:
    """'model.layers.3.self_attn.q_proj' -> 'blk.3.attn_q'; None for modules the decoder does not use."""
    if hf_module in _TOP:
        return _TOP[hf_module]
    m = _LAYER_RE.fullmatch(hf_module)
    if m and m.group(2) in _LAYER:
        return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}"
    return None


_FLOAT_GGML = {"F16": GGMLType.F16, "BF16": GGMLType.BF16, "F32": GGMLType.F32}


def load_weights(root: Path, group_size: int) -> dict:
    """GGUF tensor name -> AWQTensor (quantized linears) or float QTensor (everything else), zero-copy."""
    where = open_shards(root)
    modules: dict[str, dict[str, str]] = {}
    for name in where:
        mod, _, suffix = name.rpartition(".")
        modules.setdefault(mod, {})[suffix] = name
    weights: dict = {}
    for mod, parts in modules.items():
        gname = gguf_module_name(mod)
        if gname is None:
            continue  # rotary inv_freq and anything else the decoder does not read
        if "qweight" in parts:
            missing = [p for p in ("qzeros", "scales") if p not in parts]
            if missing:
                raise AWQError(f"{root}: {mod}.qweight has no {mod}.{missing[0]}")
            f = where[parts["qweight"]]
            weights[gname + ".weight"] = AWQTensor(f.get(parts["qweight"]), where[parts["qzeros"]].get(parts["qzeros"]),
                                                   where[parts["scales"]].get(parts["scales"]), group_size,
                                                   name=f"{mod}")
        for suffix in ("weight", "bias"):
            if suffix in parts:
                hf_name = parts[suffix]
                f = where[hf_name]
                dt, shape, _, _ = f.tensors[hf_name]
                if dt not in _FLOAT_GGML:
                    raise AWQError(f"{f.path}: {hf_name} has dtype {dt}, expected a float type")
                weights[f"{gname}.{suffix}"] = QTensor(_FLOAT_GGML[dt], shape, f.raw(hf_name), hf_name)
    return weights
