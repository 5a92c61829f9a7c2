"""config.json of an AWQ folder: the quantization_config pyllm reads ("gemm", 4 bits, zero points, a group size)
and the architecture's ModelConfig, each value checked with an error naming it."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from ...errors import AWQError, PyllmError
from ...models.config import ModelConfig
from ...safe_io import read_json

SUPPORTED_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
OTHER_VERSIONS = ("gemv", "gemv_fast", "marlin", "exllama", "ipex")


def short(v) -> str:
    """A value for an error message: its repr, cut to 40 characters."""
    text = repr(v)
    return text if len(text) <= 40 else text[:39] + "…"


def read_folder_json(path: Path, required: bool = True) -> dict:
    """A JSON object file of the folder: regular, bounded in size and depth, UTF-8 (AWQError otherwise)."""
    if not os.path.lexists(path):
        if required:
            raise AWQError(f"{path.parent}: {path.name} is missing")
        return {}
    return read_json(path, AWQError)


def is_awq_dir(path) -> bool:
    """A folder whose config.json says quant_method awq (cheap: reads config.json only)."""
    p = Path(path)
    cfg = p / "config.json"
    if not (p.is_dir() and cfg.is_file()):
        return False
    try:
        qc = read_json(cfg).get("quantization_config") or {}
    except PyllmError:
        return False
    return isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "awq"


def read_quant_config(root: Path, hf: dict) -> dict:
    """Validated {"group_size", "modules_to_not_convert"} from config.json's quantization_config."""
    qc = hf.get("quantization_config")
    src = root / "config.json"
    if not isinstance(qc, dict):
        raise AWQError(f"{src}: has no quantization_config (not a quantized checkpoint)")
    method = str(qc.get("quant_method", "")).lower()
    if method != "awq":
        raise AWQError(f"{src}: quantization_config.quant_method = {qc.get('quant_method')!r}, expected 'awq'")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise AWQError(f"{src}: quantization_config.bits = {bits!r}; only 4-bit AWQ is supported")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise AWQError(f"{src}: AWQ version {version!r} is not supported (pyllm reads the 'gemm' layout; "
                       f"{', '.join(OTHER_VERSIONS)} are different packings)")
    if qc.get("zero_point", True) is False:
        raise AWQError(f"{src}: quantization_config.zero_point = false (symmetric AWQ) is not supported")
    g = qc.get("group_size", qc.get("q_group_size", 128))
    if isinstance(g, bool) or not isinstance(g, int) or not (g == -1 or g > 0):
        raise AWQError(f"{src}: quantization_config.group_size = {g!r} is not a positive integer (or -1)")
    skip = qc.get("modules_to_not_convert") or []
    if not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
        raise AWQError(f"{src}: quantization_config.modules_to_not_convert = {short(skip)} is not a list of "
                       f"module names")
    return {"group_size": g, "modules_to_not_convert": list(skip)}


def config_from_hf(hf: dict, source: str, tensor_names: set[str]) -> ModelConfig:
    """config.json of a llama / mistral / qwen2 / qwen3 checkpoint -> ModelConfig (GGUF tensor names)."""
    mt = hf.get("model_type")
    arch = SUPPORTED_ARCHS.get(mt) if isinstance(mt, str) else None
    if arch is None:
        raise AWQError(f"{source}: model_type {mt!r} is not supported for AWQ (supported: "
                       f"{', '.join(sorted(SUPPORTED_ARCHS))})")
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf

    # The bounds of ModelConfig.from_metadata for the same values in a GGUF file: the kernels take them as int32,
    # and shape_mismatch walks every layer (a count of 10**8 would take minutes and all memory to refuse).
    def get_int(key, default=None, lo=1, hi=(1 << 31) - 1):
        v = text.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise AWQError(f"{source}: {key} = {short(v)} is not an integer in [{lo}, {hi}]")
        return v

    def get_float(key, default, hi=float("inf"), where=None):
        v = (text if where is None else where).get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= hi:
            bound = f" and <= {hi:g}" if hi < float("inf") else ""
            label = key if where is None else f"rope scaling {key}"
            raise AWQError(f"{source}: {label} = {short(v)} is not a finite number > 0{bound}")
        return float(v)

    n_embd = get_int("hidden_size")
    n_head = get_int("num_attention_heads")
    n_kv = get_int("num_key_value_heads", n_head)
    if n_head % n_kv:
        raise AWQError(f"{source}: num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_kv}")
    hd = text.get("head_dim")
    head_dim = get_int("head_dim") if hd is not None else n_embd // n_head
    if head_dim % 2:  # the rotation turns pairs of values
        raise AWQError(f"{source}: head_dim {head_dim} is odd; rotary embeddings need an even head dimension")
    rp = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        rp = {}
    base = get_float("rope_theta", rp.get("rope_theta", 10000.0))
    rope_type = rp.get("rope_type", rp.get("type", "default")) or "default"
    if rope_type not in ("default", "llama3"):
        raise AWQError(f"{source}: rope scaling {rope_type!r} is not supported")
    if rope_type == "llama3":
        lo, hi = get_float("low_freq_factor", 1.0, where=rp), get_float("high_freq_factor", 4.0, where=rp)
        get_float("factor", 8.0, where=rp), get_float("original_max_position_embeddings", 8192, where=rp)
        if not hi > lo:  # the factors interpolate between the two
            raise AWQError(f"{source}: rope scaling high_freq_factor {hi:g} is not above low_freq_factor {lo:g}")
    sliding = arch == "mistral" or text.get("use_sliding_window")
    sw = get_int("sliding_window", 0, lo=0) if sliding and text.get("sliding_window") is not None else 0
    cfg = ModelConfig(
        arch=arch,
        n_layer=get_int("num_hidden_layers", hi=4096),
        n_embd=n_embd,
        n_ff=get_int("intermediate_size"),
        n_head=n_head,
        n_kv_head=n_kv,
        head_dim=head_dim,
        n_vocab=get_int("vocab_size"),
        n_ctx_train=get_int("max_position_embeddings", 4096),
        rope_base=float(base),
        rope_dim=head_dim,
        rope_style="neox",
        rms_eps=get_float("rms_norm_eps", 1e-6, hi=1.0),
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        tied_output="output.weight" not in tensor_names,
        sliding_window=sw,
    )
    if rope_type == "llama3":
        cfg.extra["llama3_rope"] = rp
    return cfg


def llama3_rope_factors(cfg: ModelConfig, rp: dict) -> torch.Tensor:
    """The per-frequency divisors llama.cpp's converter stores as rope_freqs.weight for llama3 rope scaling."""
    factor = float(rp.get("factor", 8.0))
    lo, hi = float(rp.get("low_freq_factor", 1.0)), float(rp.get("high_freq_factor", 4.0))
    old = float(rp.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (cfg.rope_base ** (torch.arange(0, cfg.rope_dim, 2, dtype=torch.float64) / cfg.rope_dim))
    out = []
    for f in freqs.tolist():
        wl = 2 * math.pi / f
        if wl < old / hi:
            out.append(1.0)
        elif wl > old / lo:
            out.append(factor)
        else:
            smooth = (old / wl - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)
