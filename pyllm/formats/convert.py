"""Hugging Face checkpoint (config.json, safetensors, tokenizer.json) -> GGUF, written with the ``gguf`` package.

The output follows llama.cpp's convert_hf_to_gguf.py where it matters for loading: tensor names from gguf's
TensorNameMap, llama-arch Q/K rows permuted for the interleaved rotation, llama3 rope scaling as a ``rope_freqs``
tensor, Gemma norms stored as (1 + w), byte-level BPE vocabularies with merges and the pre-tokenizer name.
Weights are quantized by pyllm.formats.quantize (1-D tensors stay float32, as llama.cpp keeps them); as llama.cpp's
quantizer does, the output head is Q6_K under q4_0 and q4_k_m, and ``general.quantization_version`` is 2.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import torch

from . import convert_encoder, convert_gpt_oss
from ..errors import ConvertError
from .gguf import GGMLType
from .quantize import QUANTIZERS, quantize
from ..safe_io import check_regular, private_tempfile, read_json, read_regular

__all__ = ["ConvertError", "convert"]


# HF model_type -> GGUF architecture. Mistral is written as "llama" (as llama.cpp does) plus its sliding window.
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
        "gemma3_text": "gemma3", "smollm3": "smollm3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
        "gpt_oss": "gpt-oss"}
PERMUTE_QK = {"llama", "smollm3"}  # archs whose runtime uses the interleaved ("norm") rotation
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "q4_k_m": 15, "mxfp4_moe": 38}
# mxfp4_moe (llama.cpp's MOSTLY_MXFP4_MOE): the stacked experts MXFP4, the other matrices Q8_0
BASE_TYPE = {"f32": GGMLType.F32, "f16": GGMLType.F16, "q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0,
             "q4_k_m": GGMLType.Q4_K, "mxfp4_moe": GGMLType.Q8_0}


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp's LlamaModel.permute: HF's half-split rotation order -> interleaved pairs within each head.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_json(path: Path) -> dict:
    """A JSON object file of the checkpoint ({} when absent): regular, bounded in size and depth, UTF-8."""
    if not os.path.lexists(path):
        return {}
    return read_json(path, ConvertError)


def _load_tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{d}: no *.safetensors files (only safetensors checkpoints are supported)")
    out = {}
    for f in files:
        check_regular(f, ConvertError)  # safetensors' native open would block on a FIFO with the GIL held
        try:
            with safe_open(str(f), framework="pt") as s:
                for k in s.keys():
                    out[k] = s.get_tensor(k)
        except (SafetensorError, OSError) as e:  # a truncated file, a header that is not JSON, a directory
            raise ConvertError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0] if str(e) else e})") \
                from None
    return out


# config.json values the conversion writes as GGUF integers / floats: checked here, so a string or a negative
# is named instead of failing inside the writer's struct.pack (or int()/float()) with a traceback.
INT32_MAX = (1 << 31) - 1
CONFIG_INTS = {"num_hidden_layers": (1, 4096), "hidden_size": (1, INT32_MAX), "num_attention_heads": (1, INT32_MAX),
               "intermediate_size": (1, INT32_MAX), "num_key_value_heads": (1, INT32_MAX), "head_dim": (1, INT32_MAX),
               "vocab_size": (1, INT32_MAX), "max_position_embeddings": (1, INT32_MAX),
               "sliding_window": (0, INT32_MAX),  # a window of 0 is none
               "num_experts": (1, 1 << 16), "num_local_experts": (1, 1 << 16), "num_experts_per_tok": (1, 1 << 16),
               "moe_intermediate_size": (1, INT32_MAX), "shared_expert_intermediate_size": (0, INT32_MAX)}
CONFIG_FLOATS = ("rms_norm_eps", "rope_theta", "partial_rotary_factor", "rope_local_base_freq")
ROPE_FLOATS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
               "partial_rotary_factor", "beta_fast", "beta_slow")


def _check_config_values(cfg: dict, source: str) -> None:
    def check_float(where: str, v) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ConvertError(f"{source}: {where} = {v!r} is not a finite number > 0")

    for key, (lo, hi) in CONFIG_INTS.items():
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
            raise ConvertError(f"{source}: {key} = {v!r} is not an integer in [{lo}, {hi}]")
    for key in CONFIG_FLOATS:
        if cfg.get(key) is not None:
            check_float(key, cfg[key])
    for key in ("rope_scaling", "rope_parameters"):
        rp = cfg.get(key)
        if rp is None:
            continue
        if not isinstance(rp, dict):
            raise ConvertError(f"{source}: {key} = {rp!r} is not an object")
        groups = [rp] + [v for v in rp.values() if isinstance(v, dict)]  # gemma3: one per layer type
        for group in groups:
            for name in ROPE_FLOATS:
                if group.get(name) is not None:
                    check_float(f"{key}.{name}", group[name])
            lo, hi = group.get("low_freq_factor", 1.0), group.get("high_freq_factor", 4.0)
            if group.get("rope_type", group.get("type")) == "llama3" and not hi > lo:  # _llama3_factors divides
                raise ConvertError(f"{source}: {key}.high_freq_factor {hi!r} is not above low_freq_factor {lo!r}")
    if not isinstance(cfg.get("_name_or_path", ""), str):
        raise ConvertError(f"{source}: _name_or_path = {cfg['_name_or_path']!r} is not a string")
    _check_config_shapes(cfg, source)


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:59] + "…"


def _check_config_shapes(cfg: dict, source: str) -> None:
    """The fields the conversion combines: heads that divide, a rotary part in (0, 1] of an even head dimension
    (the rotation turns pairs of values), flags that are booleans and rope groups that are objects."""
    n_embd, n_head = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    n_kv = cfg.get("num_key_value_heads") or n_head
    if isinstance(n_head, int) and isinstance(n_kv, int) and n_head % n_kv:
        raise ConvertError(f"{source}: num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_kv}")
    head_dim = cfg.get("head_dim")
    if head_dim is None and isinstance(n_embd, int) and isinstance(n_head, int):
        if n_embd % n_head:
            raise ConvertError(f"{source}: hidden_size {n_embd} is not a multiple of num_attention_heads {n_head} "
                               f"(and there is no head_dim)")
        head_dim = n_embd // n_head
    for key in ("rope_scaling", "rope_parameters"):
        rp = cfg.get(key)
        if isinstance(rp, dict):
            for name in ("rope_type", "type"):
                if rp.get(name) is not None and not isinstance(rp[name], str):
                    raise ConvertError(f"{source}: {key}.{name} = {_short(rp[name])} is not a string")
            for name in ("full_attention", "sliding_attention"):
                if name in rp and not isinstance(rp[name], dict):
                    raise ConvertError(f"{source}: {key}.{name} = {_short(rp[name])} is not an object")
    rs = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    factor = cfg.get("partial_rotary_factor", rs.get("partial_rotary_factor", 1.0))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConvertError(f"{source}: partial_rotary_factor = {_short(factor)} is not a number in (0, 1]")
    if isinstance(head_dim, int):
        rope_dim = int(head_dim * factor)
        if head_dim % 2 or rope_dim < 2 or rope_dim % 2:
            raise ConvertError(f"{source}: head_dim {head_dim} with partial_rotary_factor {factor:g} gives "
                               f"{rope_dim} rotated dimensions; the rotation needs an even number of them (>= 2)")
    for key in ("tie_word_embeddings", "use_sliding_window"):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise ConvertError(f"{source}: {key} = {_short(cfg[key])} is not true or false")
    for key in ("bos_token_id", "eos_token_id"):
        v = cfg.get(key)
        ids = v if isinstance(v, list) else [v]
        if v is not None and not all(_is_id(i) for i in ids):
            raise ConvertError(f"{source}: {key} = {_short(v)} is not a token id (or a list of them)")
    q = cfg.get("query_pre_attn_scalar")
    if q is not None and (isinstance(q, bool) or not isinstance(q, (int, float)) or not math.isfinite(q) or q <= 0):
        raise ConvertError(f"{source}: query_pre_attn_scalar = {_short(q)} is not a finite number > 0")


def _rope(cfg: dict) -> tuple[float, dict]:
    # transformers 5 writes rope_parameters (theta inside); older configs write rope_theta + rope_scaling.
    rp = dict(cfg.get("rope_parameters") or {})
    if "full_attention" in rp:  # per-layer-type parameters (gemma3): the global layers' are the file's
        rp = dict(rp["full_attention"])
    rs = dict(cfg.get("rope_scaling") or {})
    theta = cfg.get("rope_theta") or rp.get("rope_theta") or 10000.0
    scaling = {**rs, **rp}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), scaling | {"rope_type": kind}


def _llama3_factors(theta: float, dim: int, sc: dict) -> np.ndarray:
    # llama.cpp LlamaModel.generate_extra_tensors: per-frequency divisors that transformers' llama3 rope applies.
    factor = sc.get("factor", 8.0)
    lo, hi = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old = sc.get("original_max_position_embeddings", 8192)
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    lo_wl, hi_wl = old / lo, old / hi
    out = []
    for f in freqs.tolist():
        wl = 2 * math.pi / f
        if wl < hi_wl:
            out.append(1.0)
        elif wl > lo_wl:
            out.append(factor)
        else:
            smooth = (old / wl - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _pretokenizer_name(tj: dict) -> str:
    """llama.cpp names the pre-tokenizer by hashing its output; we recognise the tokenizer.json structure."""
    pt = tj.get("pre_tokenizer") or {}
    if not isinstance(pt, dict):
        raise ConvertError(f"tokenizer.json: pre_tokenizer = {_short(pt)} is not an object")
    parts = pt.get("pretokenizers", [pt]) if pt.get("type") == "Sequence" else [pt]
    if not (isinstance(parts, list) and all(isinstance(p, dict) for p in parts)):
        raise ConvertError(f"tokenizer.json: pre_tokenizer.pretokenizers = {_short(parts)} is not a list of objects")
    text = json.dumps(parts)
    if any(p.get("type") == "Digits" and p.get("individual_digits") for p in parts):
        return "smollm"
    if "\\\\p{N}{1,3}" in text or "\\p{N}{1,3}" in text:
        return "llama-bpe"
    if "[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}|" in text or "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|" in text:
        return "qwen2"
    if len(parts) == 1 and parts[0].get("type") == "ByteLevel" and parts[0].get("use_regex", True):
        return "gpt-2"  # llama.cpp's name (llama-vocab.cpp): it refuses "gpt2" as an unknown pre-tokenizer
    raise ConvertError(f"unrecognised pre-tokenizer in tokenizer.json: {text[:200]}")


def _is_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _token_id(tok, vocab: dict) -> int | None:
    if isinstance(tok, dict):
        tok = tok.get("content")
    return vocab.get(tok) if isinstance(tok, str) else None


def _write_tokenizer(w, d: Path, cfg: dict, n_vocab: int) -> None:
    import gguf

    if not os.path.lexists(d / "tokenizer.json"):
        raise ConvertError(f"{d}: tokenizer.json is missing (pyllm converts checkpoints with a Hugging Face "
                           f"fast tokenizer file; save one with AutoTokenizer.from_pretrained(...).save_pretrained)")
    tj = _read_json(d / "tokenizer.json")
    tc = _read_json(d / "tokenizer_config.json")
    model = tj.get("model") or {}
    if not isinstance(model, dict) or model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ConvertError(f"{d}/tokenizer.json: only byte-level BPE tokenizers are supported "
                           f"(model type {model.get('type') if isinstance(model, dict) else model!r})")
    vocab, added_list = model.get("vocab"), tj.get("added_tokens") or []
    if not (isinstance(vocab, dict) and vocab and all(_is_id(i) for i in vocab.values())):
        raise ConvertError(f"{d}/tokenizer.json: model.vocab is not a map of token texts to ids")
    if not (isinstance(added_list, list) and all(isinstance(a, dict) and _is_id(a.get("id"))
                                                 and isinstance(a.get("content"), str) for a in added_list)):
        raise ConvertError(f"{d}/tokenizer.json: added_tokens is not a list of {{\"id\", \"content\"}} entries")
    vocab = dict(vocab)
    added = {a["id"]: a for a in added_list}
    for i, a in added.items():
        vocab[a["content"]] = i
    if max(vocab.values()) >= n_vocab:
        raise ConvertError(f"{d}: tokenizer has id {max(vocab.values())} but the model's vocab_size is {n_vocab}")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    for t, i in vocab.items():
        tokens[i] = t
        a = added.get(i)
        types[i] = (gguf.TokenType.NORMAL if a is None else
                    gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED)
    merges = _merges(model.get("merges", []), d / "tokenizer.json")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_pretokenizer_name(tj))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    bos = _token_id(tc.get("bos_token"), vocab)
    eos = _token_id(tc.get("eos_token"), vocab)
    bos = bos if bos is not None else cfg.get("bos_token_id")
    eos = eos if eos is not None else cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    for key, tid in (("bos_token_id", bos), ("eos_token_id", eos)):
        if tid is not None and not (_is_id(tid) and tid < n_vocab):
            raise ConvertError(f"{d}/config.json: {key} = {tid!r} is not a token id of the vocabulary of {n_vocab}")
    if bos is not None:
        w.add_bos_token_id(int(bos))
    if eos is not None:
        w.add_eos_token_id(int(eos))
    pad = _token_id(tc.get("pad_token"), vocab)
    if pad is not None:
        w.add_pad_token_id(pad)
    add_bos = tc.get("add_bos_token", False)
    if not isinstance(add_bos, bool):
        raise ConvertError(f"{d}/tokenizer_config.json: add_bos_token = {_short(add_bos)} is not true or false")
    w.add_add_bos_token(add_bos)
    tmpl = tc.get("chat_template")
    if isinstance(tmpl, list):  # named templates: the default one
        tmpl = next((t.get("template") for t in tmpl if isinstance(t, dict) and t.get("name") == "default"), None)
    if tmpl is not None and not isinstance(tmpl, str):
        raise ConvertError(f"{d}/tokenizer_config.json: chat_template = {_short(tmpl)} is not a string")
    if tmpl is None and os.path.lexists(d / "chat_template.jinja"):
        tmpl = _read_template(d / "chat_template.jinja")
    if tmpl:
        w.add_chat_template(tmpl)


MAX_TEMPLATE_BYTES = 1 << 20


def _read_template(path: Path) -> str:
    """chat_template.jinja: a regular file of UTF-8 text (the template a GGUF file carries is a string; bytes that
    are not UTF-8 are refused here, naming the offset, rather than carried into the output)."""
    raw = read_regular(path, MAX_TEMPLATE_BYTES, ConvertError)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConvertError(f"{path}: the chat template is not UTF-8 text (byte {raw[e.start]:#04x} at offset "
                           f"{e.start})") from None


def _merges(merges, source: Path) -> list[str]:
    """tokenizer.json's model.merges as GGUF writes them ("a b"): each entry a string of two space-separated
    parts or a pair of strings (the newer format)."""
    if not isinstance(merges, list):
        raise ConvertError(f"{source}: model.merges = {_short(merges)} is not a list")
    out = []
    for i, m in enumerate(merges):
        if isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) and x for x in m):
            m = " ".join(m)
        if not (isinstance(m, str) and len(m.split(" ")) == 2 and all(m.split(" "))):
            raise ConvertError(f"{source}: model.merges[{i}] = {_short(m)} is not a merge (\"a b\" or [\"a\", \"b\"])")
        out.append(m)
    return out


def _tensor_type(name: str, arr_shape: tuple, ftype: str, layer_info: tuple[int, int] | None,
                 tied: bool) -> GGMLType:
    if len(arr_shape) == 1 or ftype == "f32" or ".ffn_gate_inp" in name or name.endswith(".bias"):
        # llama.cpp leaves routers and biases (gpt-oss's experts' are [E, rows]) unquantized
        return GGMLType.F32
    t = BASE_TYPE[ftype]
    if ftype == "mxfp4_moe" and "_exps.weight" in name:
        t = GGMLType.MXFP4
    if ftype == "q4_0" and (name == "output.weight" or (tied and name == "token_embd.weight")):
        # llama.cpp's quantizer (llama_tensor_get_type) gives the output head Q6_K for every type below Q8_0,
        # or Q8_0 when its rows are not whole 256-blocks
        t = GGMLType.Q6_K if arr_shape[-1] % 256 == 0 else GGMLType.Q8_0
    if ftype == "q4_k_m":
        # llama.cpp's Q4_K_M mix: Q6_K for the output head and for attn_v / ffn_down on the "more bits" layers
        # (first and last eighth, and every third in between). A tied embedding is the output head too.
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            t = GGMLType.Q6_K
        elif layer_info and (".attn_v." in name or ".ffn_down" in name):  # ffn_down_exps / _shexp too, as llama.cpp
            i, n = layer_info
            if i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2:
                t = GGMLType.Q6_K
    bs = QUANTIZERS[t][0] if t in QUANTIZERS else 1
    if arr_shape[-1] % bs:
        # Rows that do not hold whole blocks: a 32-block type if it fits (llama.cpp falls back similarly), else f16.
        t = GGMLType.Q8_0 if arr_shape[-1] % 32 == 0 else GGMLType.F16
    return t


def convert(hf_dir: str | Path, out_path: str | Path, ftype: str = "f16", log=print) -> Path:
    import gguf

    d, out_path = Path(hf_dir), Path(out_path)
    if ftype not in BASE_TYPE:
        raise ConvertError(f"unknown --type {ftype!r} (choose one of: {', '.join(BASE_TYPE)})")
    if not d.is_dir():
        raise ConvertError(f"{d}: not a directory (expected a Hugging Face checkpoint)")
    cfg = _read_json(d / "config.json")
    if not cfg:
        raise ConvertError(f"{d}: config.json is missing")
    cfg = {k: v for k, v in cfg.items() if v is not None}  # HF writes null for "not set": the defaults apply
    if isinstance(cfg.get("text_config"), dict) and not (isinstance(cfg.get("model_type"), str)
                                                        and cfg["model_type"] in ARCH):
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
        cfg = {k: v for k, v in cfg.items() if v is not None}
    mt = cfg.get("model_type")
    arch = ARCH.get(mt) if isinstance(mt, str) else None
    encoder = convert_encoder.ENCODER_TYPES.get(mt) if isinstance(mt, str) else None  # BERT-family embedders
    if arch is None and encoder is None:
        raise ConvertError(f"{d}/config.json: model_type {mt!r} is not supported (supported: "
                           f"{', '.join([*ARCH, *convert_encoder.ENCODER_TYPES])})")
    if encoder is None:
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size")
                   if not isinstance(cfg.get(k), int)]
        if missing:
            raise ConvertError(f"{d}/config.json: missing or non-integer {', '.join(missing)}")
        _check_config_values(cfg, f"{d}/config.json")
    else:
        convert_encoder.encoder_hparams(cfg, encoder, f"{d}/config.json")  # refused before the weights are read
    _check_output(d, out_path)
    tensors = _load_tensors(d)

    # Written next to the target and renamed at the end: an interrupted conversion leaves no half file behind.
    # The temporary name is mkstemp's (created exclusively, unpredictable): a symlink planted at a fixed name
    # such as OUT.part would have sent the writer's open() to its target.
    tmp = None
    try:
        fd, tmp = private_tempfile(out_path.parent, f".{out_path.name}.", ".part")
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would make the model readable by its owner only
        os.close(fd)
        w = gguf.GGUFWriter(str(tmp), arch or encoder)
        if encoder is None:
            _write(gguf, w, d, cfg, arch, mt, tensors, ftype, log)
        else:
            out = convert_encoder.write_encoder_header(gguf, w, d, cfg, encoder, tensors, FILE_TYPES[ftype],
                                                       cfg.get("_name_or_path") or d.name)
            _write_tensors(gguf, w, out, ftype, cfg.get("num_hidden_layers") or cfg.get("n_layer"), False, log)
        w.close()
        tmp.replace(out_path)
        tmp = None
    except OSError as e:  # a full disk, a folder that is not writable
        raise ConvertError(f"{out_path}: cannot write the output: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return out_path


# What convert reads from the checkpoint folder: the output must not replace one of them.
INPUT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "*.safetensors")


def _check_output(d: Path, out: Path) -> None:
    """ConvertError for an output path that cannot or must not be replaced by the finished file (renamed over it,
    so a device such as /dev/null would itself be replaced when run as root)."""
    if out.is_dir():
        raise ConvertError(f"{out}: is a directory; give the name of the .gguf file to write")
    if out.exists() and not out.is_file():
        raise ConvertError(f"{out}: is not a regular file (a device or a pipe); give the name of a .gguf file")
    if not out.parent.is_dir():
        raise ConvertError(f"{out}: the folder {out.parent} does not exist")
    if out.exists():
        inputs = [p for pattern in INPUT_FILES for p in d.glob(pattern) if p.is_file()]
        same = next((p for p in inputs if out.samefile(p)), None)
        if same is not None:
            raise ConvertError(f"{out}: is the checkpoint's own {same.name}, which the conversion reads; give "
                               f"another output name")


LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # HF's per-layer tensor names: model.layers.N.*


def _check_tensors(d: Path, arch: str, names, tensors: dict, n_layer: int, n_embd: int, n_ff: int, n_head: int,
                   n_kv: int, head_dim: int, n_vocab: int | None, moe: dict | None = None) -> None:
    """ConvertError naming the first tensor that contradicts config.json, before anything is written. The shapes
    expected are the loader's own (ModelConfig.layer_shapes), so a file written here never fails to load on a
    shape; phi3's fused attn_qkv and gate+up ffn_up are checked as its checkpoints store them (split at load)."""
    from ..models.config import ModelConfig

    layers = {int(m.group(1)): hf for hf in tensors if (m := LAYER.search(hf))}
    beyond = [i for i in sorted(layers) if i >= n_layer]
    if beyond:
        raise ConvertError(f"{d}: tensor {layers[beyond[0]]} is in layer {beyond[0]}, but config.json has "
                           f"num_hidden_layers = {n_layer}")
    absent = [i for i in range(n_layer) if i not in layers]
    if absent:
        raise ConvertError(f"{d}: config.json has num_hidden_layers = {n_layer}, but the checkpoint has no tensors "
                           f"for layer {absent[0]}" + (f" (nor {len(absent) - 1} more)" if len(absent) > 1 else ""))
    if "model.embed_tokens.weight" not in tensors:
        raise ConvertError(f"{d}: the checkpoint has no model.embed_tokens.weight (the token embedding)")
    want = ModelConfig(arch=arch, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_kv_head=n_kv,
                       head_dim=head_dim, n_vocab=n_vocab or 0, n_ctx_train=0, extra=dict(moe or {})).layer_shapes()
    want["attn_qkv.weight"] = ((n_head + 2 * n_kv) * head_dim, n_embd)
    if arch == "phi3":
        want["ffn_up.weight"] = (2 * n_ff, n_embd)
    want["output_norm.weight"] = (n_embd,)
    sizes = (f"hidden_size {n_embd}, num_attention_heads {n_head}, num_key_value_heads {n_kv}, head_dim {head_dim}, "
             f"intermediate_size {n_ff}")
    if moe:
        sizes += (f", num_experts {moe['expert_count']}, moe_intermediate_size {moe['expert_ff']}, "
                  f"shared_expert_intermediate_size {moe['expert_shared_ff']}")
    for hf, t in tensors.items():
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None:
            continue  # reported (or skipped, as rotary_emb.inv_freq) where the tensors are written
        got = tuple(t.shape)
        if name in ("token_embd.weight", "output.weight"):  # a row per token, no more (ModelConfig.shape_mismatch)
            if len(got) != 2 or got[1] != n_embd or (n_vocab and got[0] != n_vocab):
                raise ConvertError(f"{d}: tensor {hf} has shape {got}, but config.json (hidden_size {n_embd}"
                                   + (f", vocab_size {n_vocab}" if n_vocab else "") + f") needs "
                                   f"({n_vocab or 'n_vocab'}, {n_embd})")
            continue
        exp = want.get(name.split(".", 2)[2] if name.startswith("blk.") else name)
        if exp is not None and got != exp:
            raise ConvertError(f"{d}: tensor {hf} has shape {got}, but config.json ({sizes}) needs {exp}")


def _check_smollm3(d: Path, cfg: dict, n_layer: int) -> None:
    """SmolLM3's GGUF has no key for which layers skip RoPE or attend to a window: llama.cpp's smollm3 graph (and
    pyllm's spec entry) takes every 4th layer as NoPE and every layer as global.  A checkpoint that says otherwise
    would convert into a file that runs another model, so it is refused, naming the field."""
    want = [int((i + 1) % 4 != 0) for i in range(n_layer)]
    got = cfg.get("no_rope_layers", want)
    if got != want:
        raise ConvertError(f"{d}/config.json: no_rope_layers = {_short(got)} is not every 4th layer without RoPE "
                           f"({_short(want)}), the only pattern a smollm3 GGUF file can hold")
    if cfg.get("use_sliding_window"):
        raise ConvertError(f"{d}/config.json: use_sliding_window = true: a smollm3 GGUF file has no sliding window")


EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _moe_config(d: Path, cfg: dict) -> dict:
    """A mixture-of-experts checkpoint's routing fields as ModelConfig.extra names them, checked: every layer a
    mixture (the files llama.cpp and pyllm run have no dense layers between them), top-k within the experts."""
    src = f"{d}/config.json"
    if "num_experts" not in cfg and "num_local_experts" in cfg:  # transformers 5 writes Qwen3-MoE's under this name
        cfg = {**cfg, "num_experts": cfg["num_local_experts"]}
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if not isinstance(cfg.get(key), int):
            raise ConvertError(f"{src}: missing or non-integer {key} (a mixture-of-experts model)")
    if cfg["num_experts_per_tok"] > cfg["num_experts"]:
        raise ConvertError(f"{src}: num_experts_per_tok {cfg['num_experts_per_tok']} is more than num_experts "
                           f"{cfg['num_experts']}")
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ConvertError(f"{src}: mlp_only_layers {cfg.get('mlp_only_layers')!r} / decoder_sparse_step "
                           f"{cfg.get('decoder_sparse_step')!r}: dense layers between the mixture-of-experts layers "
                           f"are not supported")
    norm = cfg.get("norm_topk_prob", cfg["model_type"] == "qwen3_moe")
    if not isinstance(norm, bool):
        raise ConvertError(f"{src}: norm_topk_prob = {_short(norm)} is not true or false")
    return dict(expert_count=cfg["num_experts"], expert_used_count=cfg["num_experts_per_tok"],
                expert_ff=cfg["moe_intermediate_size"], expert_shared_ff=cfg.get("shared_expert_intermediate_size", 0),
                expert_weights_norm=norm)


def _stack_experts(d: Path, tensors: dict, n_expert: int) -> dict:
    """Per-expert checkpoint tensors (mlp.experts.E.{gate,up,down}_proj.weight, as save_pretrained writes them)
    stacked into the [n_expert, rows, cols] tensors llama.cpp's ffn_*_exps are (named mlp.experts.*_proj.weight,
    which gguf's name map knows); transformers' in-memory fused form (experts.gate_up_proj [E, 2F, D], experts.
    down_proj) split and renamed likewise; the shared expert's gate [1, D] as the vector it is."""
    out, parts = {}, {}
    for name, t in tensors.items():
        m = EXPERT.match(name)
        if m:
            parts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
        elif name.endswith(".mlp.experts.gate_up_proj") and t.dim() == 3:
            f = t.shape[1] // 2
            out[name.removesuffix("gate_up_proj") + "gate_proj.weight"] = t[:, :f]
            out[name.removesuffix("gate_up_proj") + "up_proj.weight"] = t[:, f:]
        elif name.endswith(".mlp.experts.down_proj") and t.dim() == 3:
            out[name + ".weight"] = t
        elif name.endswith(".mlp.shared_expert_gate.weight") and t.dim() == 2 and t.shape[0] == 1:
            out[name] = t.reshape(-1)
        else:
            out[name] = t
    for (prefix, proj), by_id in parts.items():
        if sorted(by_id) != list(range(n_expert)):
            missing = sorted(set(range(n_expert)) - set(by_id)) or sorted(set(by_id) - set(range(n_expert)))
            raise ConvertError(f"{d}: {prefix}.N.{proj}.weight: config.json has num_experts = {n_expert}, but the "
                               f"checkpoint's experts are {len(by_id)} (expert {missing[0]} differs)")
        shapes = {tuple(by_id[e].shape) for e in by_id}
        if len(shapes) != 1:
            raise ConvertError(f"{d}: {prefix}.N.{proj}.weight: the experts' shapes differ ({sorted(shapes)[:2]})")
        out[f"{prefix}.{proj}.weight"] = torch.stack([by_id[e] for e in range(n_expert)])
    return out


def _write(gguf, w, d, cfg, arch, mt, tensors, ftype, log) -> None:
    n_layer, n_embd = cfg["num_hidden_layers"], cfg["hidden_size"]
    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    head_dim = cfg.get("head_dim") or n_embd // n_head
    theta, rs = _rope(cfg)
    rope_dim = int(head_dim * cfg.get("partial_rotary_factor", rs.get("partial_rotary_factor", 1.0)))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], n_layer)
    moe = _moe_config(d, cfg) if mt in ("qwen2_moe", "qwen3_moe") else {}
    if moe:
        tensors = _stack_experts(d, tensors, moe["expert_count"])
    if mt == convert_gpt_oss.MODEL_TYPE:
        moe = convert_gpt_oss.moe_config(d, cfg)
        tensors = convert_gpt_oss.tensors(d, tensors)
    _check_tensors(d, arch, names, tensors, n_layer, n_embd, cfg["intermediate_size"], n_head, n_kv, head_dim,
                   cfg.get("vocab_size"), moe)
    n_vocab = cfg.get("vocab_size") or tensors["model.embed_tokens.weight"].shape[0]

    w.add_name(cfg.get("_name_or_path") or d.name)
    w.add_file_type(FILE_TYPES[ftype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)  # as convert_hf_to_gguf.py writes it (2)
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(rope_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-5))
    w.add_vocab_size(n_vocab)
    if moe:
        w.add_expert_count(moe["expert_count"])
        w.add_expert_used_count(moe["expert_used_count"])
        w.add_expert_feed_forward_length(moe["expert_ff"])
        if moe["expert_shared_ff"]:
            w.add_expert_shared_feed_forward_length(moe["expert_shared_ff"])
        w.add_expert_weights_norm(moe["expert_weights_norm"])
    if cfg.get("sliding_window") and (mt in ("mistral", "phi3", "gemma3_text")
                                      and cfg.get("use_sliding_window", True) is not False):
        w.add_sliding_window(int(cfg["sliding_window"]))
    kind = rs["rope_type"]
    extra: dict[str, np.ndarray] = {}
    if kind == "llama3":
        extra["rope_freqs.weight"] = _llama3_factors(theta, rope_dim, rs)
    elif kind == "linear":
        if rs.get("factor") is None:
            raise ConvertError(f"{d}/config.json: linear rope scaling without a factor")
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rs["factor"]))
    elif mt == convert_gpt_oss.MODEL_TYPE:
        convert_gpt_oss.write_metadata(gguf, w, cfg, rs, d)  # the window and YaRN
    elif kind != "default":
        raise ConvertError(f"{d}/config.json: rope scaling {kind!r} is not supported (default, linear, llama3)")
    if mt == "gemma3_text":
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta")
        local = local or cfg.get("rope_local_base_freq") or 10000.0
        if float(local) != 10000.0:
            w.add_key_value(f"{arch}.rope.local_freq_base", float(local), gguf.GGUFValueType.FLOAT32)
        if cfg.get("query_pre_attn_scalar") not in (None, head_dim):
            raise ConvertError(f"{d}: query_pre_attn_scalar {cfg['query_pre_attn_scalar']} != head_dim "
                               "is not representable in gemma3 GGUF metadata")
    if mt == "smollm3":
        _check_smollm3(d, cfg, n_layer)
    _write_tokenizer(w, d, cfg, n_vocab)

    tied = cfg.get("tie_word_embeddings", False) or "lm_head.weight" not in tensors
    out: list[tuple[str, torch.Tensor]] = []
    for hf_name, t in tensors.items():
        if hf_name == "lm_head.weight" and tied:
            continue
        if "rotary_emb.inv_freq" in hf_name:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ConvertError(f"{d}: tensor {hf_name} has no GGUF name for architecture {arch}")
        if isinstance(t, convert_gpt_oss.Mxfp4Blocks):  # kept as the checkpoint's blocks, whatever --type says
            out.append((name, t))
            continue
        if t.dim() == 0:
            raise ConvertError(f"{d}: tensor {hf_name} is a scalar; weights have at least one dimension")
        t = t.float()
        if arch in PERMUTE_QK and name.endswith("attn_q.weight"):
            t = _permute(t, n_head)
        elif arch in PERMUTE_QK and name.endswith("attn_k.weight"):
            t = _permute(t, n_kv)
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1  # llama.cpp stores Gemma's (1 + w) so the runtime's plain RMSNorm applies
        out.append((name, t))
    for name, a in extra.items():
        out.append((name, torch.from_numpy(a)))
    _write_tensors(gguf, w, out, ftype, n_layer, tied, log)


def _write_tensors(gguf, w, out: list[tuple[str, torch.Tensor]], ftype: str, n_layer: int, tied: bool, log) -> None:
    """The tensors (GGUF name, float32 tensor) quantized to ``ftype``'s mix, then the whole file written."""
    for name, t in out:
        m = re.match(r"blk\.(\d+)\.", name)
        if isinstance(t, convert_gpt_oss.Mxfp4Blocks):
            w.add_tensor(name, t.data, raw_shape=t.data.shape, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            if log:
                log(f"{name:32s} MXFP4 {t.shape}")
            continue
        qt = _tensor_type(name, tuple(t.shape), ftype, (int(m.group(1)), n_layer) if m else None, tied)
        a = t.numpy()
        if qt == GGMLType.F32:
            w.add_tensor(name, a.astype(np.float32))
        elif qt == GGMLType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            raw = quantize(a.reshape(-1, a.shape[-1]), qt)
            raw = raw.reshape(*a.shape[:-1], raw.shape[-1])  # stacked experts: [E, N, row bytes]
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType(int(qt)))
        if log:
            log(f"{name:32s} {qt.name:5s} {tuple(t.shape)}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
