"""gpt-oss checkpoints (Hugging Face ``model_type`` gpt_oss) -> the tensors and metadata of llama.cpp's ``gpt-oss``
GGUF architecture, for pyllm.formats.convert.

What differs from the other mixture-of-experts families, as llama.cpp's convert_hf_to_gguf.py GptOssModel writes it:
- the experts are one fused tensor per layer: ``experts.gate_up_proj`` [E, D, 2F] with the gate and up columns
  interleaved (gate 0, up 0, gate 1, ...) and ``experts.down_proj`` [E, F, D], both stored as (in, out), plus their
  biases; or, in OpenAI's released checkpoints, MXFP4 ``*_blocks`` [E, rows, K/32, 16] and ``*_scales``
  [E, rows, K/32] in (out, in) order, whose codes are kept as they are (repacked to ggml's nibble order, no
  requantization: the E8M0 exponents and E2M1 codes are ggml's MXFP4 already);
- a sink logit per head (``self_attn.sinks`` -> ``attn_sinks.weight``), router and attention-output biases;
- metadata: the sliding window, the experts' hidden size, YaRN rope scaling (factor, original context).
The checkpoint's swiglu_alpha / swiglu_limit and layer_types are not in the file format (llama.cpp hard-codes 1.702,
7.0 and sliding attention in the even layers), so a checkpoint with other values is refused, naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ConvertError

MODEL_TYPE = "gpt_oss"
ARCH = "gpt-oss"
SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}  # what llama.cpp's (and pyllm's) gpt-oss graph computes

_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


@dataclass(frozen=True)
class Mxfp4Blocks:
    """A tensor already in ggml's MXFP4 blocks: ``data`` uint8 [*rows, K/32 * 17]; ``shape`` its element shape."""

    data: np.ndarray
    shape: tuple[int, ...]

    def dim(self) -> int:
        return len(self.shape)


def moe_config(d: Path, cfg: dict) -> dict:
    """The routing fields as ModelConfig.extra names them, checked; the values the file format cannot hold refused."""
    src = f"{d}/config.json"
    for key in ("num_local_experts", "num_experts_per_tok", "intermediate_size"):
        if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool):
            raise ConvertError(f"{src}: missing or non-integer {key} (a gpt-oss model)")
    if cfg["num_experts_per_tok"] > cfg["num_local_experts"]:
        raise ConvertError(f"{src}: num_experts_per_tok {cfg['num_experts_per_tok']} is more than num_local_experts "
                           f"{cfg['num_local_experts']}")
    for key, want in SWIGLU.items():
        if cfg.get(key, want) != want:
            raise ConvertError(f"{src}: {key} = {cfg[key]!r}: a gpt-oss GGUF file has no key for it, and its graph "
                               f"computes {want}")
    n = cfg["num_hidden_layers"]
    want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if cfg.get("layer_types", want) != want:
        raise ConvertError(f"{src}: layer_types is not sliding attention in the even layers and full attention in the "
                           f"odd ones, the only pattern a gpt-oss GGUF file can hold")
    if cfg.get("attention_bias", True) is not True:
        raise ConvertError(f"{src}: attention_bias = {cfg['attention_bias']!r}: gpt-oss layers have biases")
    sw = cfg.get("sliding_window")
    if not isinstance(sw, int) or isinstance(sw, bool) or sw < 1:
        raise ConvertError(f"{src}: sliding_window = {sw!r} is not an integer >= 1 (gpt-oss's local layers)")
    return dict(expert_count=cfg["num_local_experts"], expert_used_count=cfg["num_experts_per_tok"],
                expert_ff=cfg["intermediate_size"], expert_shared_ff=0, expert_weights_norm=False)


def _hf_nibbles_to_ggml(blocks: torch.Tensor) -> torch.Tensor:
    """MXFP4 codes uint8 [..., 16] in OpenAI's order (element 2i in the low nibble of byte i, 2i + 1 in the high)
    -> ggml's (element j < 16 in the low nibble of byte j, j + 16 in the high)."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32)
    return codes[..., :16] | (codes[..., 16:] << 4)


def _mxfp4(d: Path, name: str, blocks: torch.Tensor, scales: torch.Tensor) -> Mxfp4Blocks:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16 \
            or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ConvertError(f"{d}: {name}_blocks {tuple(blocks.shape)} / _scales {tuple(scales.shape)} are not uint8 "
                           f"MXFP4 blocks [E, rows, K/32, 16] and their exponents [E, rows, K/32]")
    raw = torch.cat((scales.unsqueeze(-1), _hf_nibbles_to_ggml(blocks)), dim=-1)  # [E, rows, K/32, 17]
    e, rows, nb = blocks.shape[:3]
    return Mxfp4Blocks(raw.reshape(e, rows, nb * 17).numpy(), (e, rows, nb * 32))


def _rows_of(t, start: int, step: int):
    """Every ``step``-th row from ``start`` of a float [E, rows, K] tensor or of MXFP4 blocks (whole rows)."""
    if isinstance(t, Mxfp4Blocks):
        data = np.ascontiguousarray(t.data[:, start::step])
        return Mxfp4Blocks(data, (t.shape[0], data.shape[1], t.shape[2]))
    return t[:, start::step].contiguous()


def tensors(d: Path, tensors: dict) -> dict:
    """The checkpoint's tensors under names gguf's gpt-oss name map turns into llama.cpp's: the fused experts split
    into [E, rows, cols] gate / up / down (de-interleaved, out x in) with their biases, the sinks as a weight."""
    out, fused = {}, {}
    for name, t in tensors.items():
        m = _FUSED.match(name)
        if m:
            fused.setdefault((m.group(1), m.group(2)), {})[m.group(3) or ""] = t
        elif name.endswith(".self_attn.sinks"):
            out[name + ".weight"] = t
        else:
            out[name] = t
    for (prefix, proj), parts in fused.items():
        if "_blocks" in parts or "_scales" in parts:
            if "_blocks" not in parts or "_scales" not in parts:
                raise ConvertError(f"{d}: {prefix}.{proj}: MXFP4 blocks without their scales (or scales alone)")
            w = _mxfp4(d, f"{prefix}.{proj}", parts["_blocks"], parts["_scales"])  # already (out, in)
        elif "" in parts:
            w = parts[""]
            if w.dim() != 3:
                raise ConvertError(f"{d}: {prefix}.{proj} has shape {tuple(w.shape)}, not [experts, in, out]")
            w = w.transpose(1, 2)  # (in, out) -> (out, in)
        else:
            raise ConvertError(f"{d}: {prefix}.{proj}_bias without its {prefix}.{proj} weights")
        bias = parts.get("_bias")
        if proj == "gate_up_proj":
            if w.shape[1] % 2:
                raise ConvertError(f"{d}: {prefix}.gate_up_proj has {w.shape[1]} output rows, not gate and up pairs")
            out[f"{prefix}.gate_proj.weight"], out[f"{prefix}.up_proj.weight"] = _rows_of(w, 0, 2), _rows_of(w, 1, 2)
            if bias is not None:
                out[f"{prefix}.gate_proj.bias"], out[f"{prefix}.up_proj.bias"] = bias[:, 0::2], bias[:, 1::2]
        else:
            out[f"{prefix}.down_proj.weight"] = w
            if bias is not None:
                out[f"{prefix}.down_proj.bias"] = bias
    return out


def write_metadata(gguf, w, cfg: dict, rope: dict, d: Path) -> None:
    """The keys llama.cpp's gpt-oss loader reads beyond the common ones: the window, the experts, YaRN."""
    w.add_sliding_window(int(cfg["sliding_window"]))
    kind = rope["rope_type"]
    if kind == "yarn":
        factor, orig = rope.get("factor"), rope.get("original_max_position_embeddings", 4096)
        if factor is None:
            raise ConvertError(f"{d}/config.json: yarn rope scaling without a factor")
        if rope.get("truncate", False) is not False:
            raise ConvertError(f"{d}/config.json: rope truncate = {rope['truncate']!r}: gpt-oss's YaRN ramp is not "
                               f"truncated, and the file format has no key for it")
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(factor))
        w.add_rope_scaling_orig_ctx_len(int(orig))
        for key, gguf_key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if rope.get(key) is not None:
                w.add_key_value(f"{ARCH}.rope.scaling.{gguf_key}", float(rope[key]), gguf.GGUFValueType.FLOAT32)
    elif kind != "default":
        raise ConvertError(f"{d}/config.json: rope scaling {kind!r} is not supported for gpt-oss (default, yarn)")
