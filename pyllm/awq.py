"""AWQ checkpoints (a Hugging Face folder, AutoAWQ "gemm" layout) -> the same ModelConfig / weights / tokenizer /
chat template the GGUF path produces, so the one Transformer runs them unchanged.

Format (AutoAWQ "gemm" checkpoints). For a linear layer with K = in_features, N = out_features, G = group size:
``qweight`` int32 [K, N/8] (eight nibbles per word packed along N; nibble i of word c is column 8c + ORDER[i],
ORDER = [0,2,4,6,1,3,5,7]), ``qzeros`` int32 [K/G, N/8] packed the same way, ``scales`` fp16 [K/G, N];
W^T = (q - z) * s. Only "gemm" with zero points is supported; gemv / gemv_fast / marlin / exllama / ipex and
symmetric (zero_point=false) checkpoints are rejected with a message saying so.

Safetensors shards are memory-mapped privately (a header parse + zero-copy views, like gguf.py): nothing is read
until a weight is used. Non-quantized tensors (embeddings, norms, lm_head, ``modules_to_not_convert``) become
float QTensors (F16/BF16/F32), so the GGUF kernels handle them.

HF llama checkpoints are not row-permuted the way llama-arch GGUFs are, so every HF architecture here uses the
"neox" (half-split) rotation.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
from pathlib import Path

import numpy as np
import torch

from .errors import ModelError, PyllmError, TokenizerError
from .gguf import GGMLType
from .models.config import ModelConfig
from .quant import QTensor
from .safe_io import open_regular, parse_json, read_json, read_regular

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
SUPPORTED_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
OTHER_VERSIONS = ("gemv", "gemv_fast", "marlin", "exllama", "ipex")


class AWQError(ModelError):
    """An AWQ folder is incomplete, inconsistent or uses a layout pyllm does not support."""


# ---------------------------------------------------------------------------------------------------- the tensor
class AWQTensor:
    """One AWQ "gemm" linear weight W [N, K] kept packed: qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]."""

    qtype = "AWQ_GEMM_W4"
    is_float = False

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 name: str = "tensor"):
        where = f"{name!r}"
        if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
            raise AWQError(f"{where}: qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}")
        if scales.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise AWQError(f"{where}: scales must be a float tensor, got {scales.dtype}")
        if qweight.dim() != 2 or qzeros.dim() != 2 or scales.dim() != 2:
            raise AWQError(f"{where}: qweight, qzeros and scales must be 2-D, got shapes "
                           f"{tuple(qweight.shape)}, {tuple(qzeros.shape)}, {tuple(scales.shape)}")
        k, n8 = qweight.shape
        n = n8 * 8
        g = k if group_size in (-1, 0) else group_size
        if g <= 0 or k % g:
            raise AWQError(f"{where}: in_features {k} is not a multiple of group_size {g}")
        if tuple(scales.shape) != (k // g, n):
            raise AWQError(f"{where}: scales shape {tuple(scales.shape)} does not match qweight {tuple(qweight.shape)}"
                           f" (expected ({k // g}, {n}) for group_size {g})")
        if tuple(qzeros.shape) != (k // g, n8):
            raise AWQError(f"{where}: qzeros shape {tuple(qzeros.shape)} does not match qweight {tuple(qweight.shape)}"
                           f" (expected ({k // g}, {n8}) for group_size {g})")
        self.qweight, self.qzeros, self.scales = qweight, qzeros, scales
        self.group_size = g
        self.shape = (n, k)
        self.name = name

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.qzeros, self.scales))

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @staticmethod
    def unpack(packed: torch.Tensor) -> torch.Tensor:
        """int32 [R, C/8] -> int32 [R, C] in logical column order (values 0..15)."""
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
        nib = (packed[:, :, None] >> shifts) & 15  # [R, C/8, 8]: nibble i holds column 8c + ORDER[i]
        rev = torch.tensor(AWQ_REVERSE_ORDER, device=packed.device)
        return nib[:, :, rev].reshape(packed.shape[0], -1)

    def dequantize_t(self, dtype: torch.dtype = torch.float32, k0: int = 0, k1: int | None = None) -> torch.Tensor:
        """W^T rows k0:k1 (k0, k1 multiples of the group size) as ``dtype`` [k1-k0, N]: (q - z) * s, the product
        formed in ``dtype`` (in float16 this is AutoAWQ's ``dequantize_gemm`` bit for bit; in float32 it is exact)."""
        g = self.group_size
        k1 = self.shape[1] if k1 is None else k1
        q = self.unpack(self.qweight[k0:k1])
        z = self.unpack(self.qzeros[k0 // g:k1 // g]).repeat_interleave(g, dim=0)
        s = self.scales[k0 // g:k1 // g].to(dtype).repeat_interleave(g, dim=0)
        return (q - z).to(dtype) * s

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W as a new ``dtype`` tensor [N, K] (the transpose of AWQ's stored W^T), in chunks of K to bound memory."""
        n, k = self.shape
        out = torch.empty((n, k), dtype=dtype, device=self.device)
        step = max(self.group_size, (1 << 22) // max(n, 1) // self.group_size * self.group_size)
        for k0 in range(0, k, step):
            k1 = min(k, k0 + step)
            out[:, k0:k1] = self.dequantize_t(dtype, k0, k1).T
        return out

    def rows(self, idx: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``idx`` of W -> ``dtype`` [*idx.shape, K] (W's rows are AWQ's columns: dequantizes the table)."""
        idx = torch.as_tensor(idx)
        flat = idx.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.shape[0]):
            raise ModelError(f"{self.name!r}: row index out of range for {self.shape[0]} rows")
        return self.dequantize(dtype)[flat].reshape(*idx.shape, self.shape[1])

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x f32 [M, K] @ W.T -> [M, N], dequantizing W^T chunk by chunk (no dense copy kept)."""
        n, k = self.shape
        x2 = x.reshape(-1, k).float()
        y = torch.zeros((x2.shape[0], n), dtype=torch.float32, device=x.device)
        step = max(self.group_size, (1 << 22) // max(n, 1) // self.group_size * self.group_size)
        for k0 in range(0, k, step):
            k1 = min(k, k0 + step)
            y += x2[:, k0:k1] @ self.dequantize_t(torch.float32, k0, k1)
        return y.reshape(*x.shape[:-1], n)

    def __repr__(self) -> str:
        return f"AWQTensor({self.name!r}, shape={self.shape}, group_size={self.group_size}, {self.nbytes} bytes)"


class AWQRows:
    """An AWQ weight repacked once at load into pyllm's CPU row layout (csrc/common/blocks.h ``AwqRow``): ``data``
    uint8 [N, 3K/G + K/2], per output row K/G fp16 scales, K/G u8 zeros, then the K 4-bit codes in the Q4_0 element
    order; ``qtype`` is the extension's internal type id for G (csrc/common/qtype.h ``AWQ_G*``, not a GGUF id).
    It has a QTensor's interface (data, qtype, shape, dequantize, rows), so ops.qmatmul / ops.embedding and the C++
    decode step run it through the same GEMV / prefill / dequantize dispatch as GGUF blocks."""

    is_float = False

    def __init__(self, data: torch.Tensor, qtype: int, shape: tuple[int, int], group_size: int, name: str = "tensor"):
        self.data, self.qtype, self.shape, self.group_size, self.name = data, qtype, tuple(shape), group_size, name

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K]: (q - z) * s in fp32 (exact), by the extension (equal to AWQTensor.dequantize bit for bit)."""
        from . import _ext

        return _ext.load().dequantize(self.data, self.qtype).to(dtype)

    def rows(self, idx: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from . import _ext

        idx = torch.as_tensor(idx)
        return _ext.load().dequantize(self.data, self.qtype, idx.reshape(-1)).to(dtype).reshape(*idx.shape, -1)

    def __repr__(self) -> str:
        return f"AWQRows({self.name!r}, qtype {self.qtype}, shape={self.shape}, group_size={self.group_size})"


def repack(w: AWQTensor, C=None) -> AWQRows | None:
    """``w`` in the CPU row layout (the C++ repacker), or None where it has none: a group size other than
    32/64/128/256, scales that fp16 cannot hold exactly (the layout stores fp16), or a non-CPU tensor."""
    if C is None:
        from . import _ext

        C = _ext.load()
    try:
        qtype = int(C.awq_qtype(w.group_size))  # the extension knows which group sizes have a layout
    except ValueError:
        return None
    if w.device.type != "cpu":
        return None
    scales = w.scales
    if scales.dtype != torch.float16:
        scales = scales.to(torch.float16)
        if not torch.equal(scales.to(w.scales.dtype), w.scales):
            return None
    data = C.awq_repack(w.qweight.contiguous(), w.qzeros.contiguous(), scales.contiguous(), w.group_size)
    return AWQRows(data, qtype, w.shape, w.group_size, w.name)


def repack_weights(weights: dict) -> int:
    """Replace every AWQTensor of ``weights`` (in place) that has a CPU row layout by its AWQRows; returns how
    many stay AWQTensor (all of them when the extension is unavailable)."""
    from . import _ext

    todo = [n for n, w in weights.items() if isinstance(w, AWQTensor)]
    try:
        C = _ext.load()
    except PyllmError:
        return len(todo)
    left = 0
    for name in todo:
        r = repack(weights[name], C)
        if r is None:
            left += 1
        else:
            weights[name] = r
    return left


# ---------------------------------------------------------------------------------------------------- safetensors
def _parse_json(raw: bytes):
    """JSON from bytes, UTF-8 and nesting bounded; ValueError (as any other malformed JSON) otherwise."""
    return parse_json(raw)


def _uint_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:39] + "…"


_ST_DTYPES = {"F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2), "F32": (torch.float32, 4),
              "I32": (torch.int32, 4), "I64": (torch.int64, 8), "U8": (torch.uint8, 1), "I8": (torch.int8, 1)}


class SafetensorsFile:
    """A safetensors file mapped privately; ``raw(name)`` is a zero-copy uint8 view, ``get(name)`` a typed one."""

    def __init__(self, path: Path):
        self.path = path
        shown = str(path)
        try:
            with open_regular(path, AWQError) as f:  # a FIFO would block the open, a device map nonsense
                size = os.fstat(f.fileno()).st_size
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        except OSError as e:
            raise AWQError(f"{shown}: cannot open: {e.strerror or e}") from None
        if size < 8:
            raise AWQError(f"{shown}: not a safetensors file ({size} bytes)")
        (hlen,) = struct.unpack("<Q", mm[:8])
        if hlen > size - 8 or hlen > 100 << 20:
            raise AWQError(f"{shown}: safetensors header length {hlen} does not fit a {size}-byte file")
        try:
            header = _parse_json(bytes(mm[8:8 + hlen]))
            if not isinstance(header, dict):
                raise ValueError("not an object")
        except ValueError as e:
            raise AWQError(f"{shown}: safetensors header is not valid JSON ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        base = 8 + hlen
        self.tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dt, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
            except (KeyError, TypeError):
                raise AWQError(f"{shown}: tensor {name!r} has a malformed header entry") from None
            # the values are used as sizes, slice bounds and dict keys: anything but the spec's types (a string
            # dtype, lists of non-negative integers) is malformed, not a float to truncate or a negative to multiply
            if not (isinstance(dt, str) and _uint_list(shape) and _uint_list(offsets) and len(offsets) == 2):
                raise AWQError(f"{shown}: tensor {name!r} has a malformed header entry (dtype {_short(dt)}, shape "
                               f"{_short(shape)}, data_offsets {_short(offsets)})")
            shape, (a, b) = tuple(shape), offsets
            if dt not in _ST_DTYPES:
                raise AWQError(f"{shown}: tensor {name!r} has dtype {dt}, which is not supported")
            n = math.prod(shape) * _ST_DTYPES[dt][1]
            if not (0 <= a <= b and b - a == n and base + b <= size):
                raise AWQError(f"{shown}: tensor {name!r} ({dt} {list(shape)}) has data offsets {a}..{b} that do not "
                               f"fit its size or the {size}-byte file (truncated?)")
            self.tensors[name] = (dt, shape, base + a, base + b)
        # numpy holds a buffer export on the mmap, so it cannot be unmapped under a live tensor (see gguf.py)
        self._u8 = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))

    def raw(self, name: str) -> torch.Tensor:
        _, _, a, b = self.tensors[name]
        return self._u8[a:b]

    def get(self, name: str) -> torch.Tensor:
        dt, shape, a, b = self.tensors[name]
        dtype, size = _ST_DTYPES[dt]
        raw = self._u8[a:b]
        if a % size:
            # the spec does not require alignment (the Rust writer pads its header to 8 bytes, others may not),
            # and a typed view needs it: such a tensor is copied
            raw = raw.clone()
        return raw.view(dtype).reshape(shape)


def _open_shards(root: Path) -> dict[str, SafetensorsFile]:
    """tensor name -> its open shard (model.safetensors.index.json if present, else every *.safetensors)."""
    index = root / "model.safetensors.index.json"
    files: dict[str, SafetensorsFile] = {}
    where: dict[str, SafetensorsFile] = {}
    if index.exists():
        wm = _read_json(index).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise AWQError(f"{index}: has no weight_map")
        odd = next((v for v in wm.values() if not isinstance(v, str)), None)
        if odd is not None:
            raise AWQError(f"{index}: weight_map names a shard {_short(odd)}, which is not a file name")
        for shard in sorted(set(wm.values())):
            p = root / str(shard)
            if not os.path.lexists(p):
                raise AWQError(f"{root}: shard {shard} named in model.safetensors.index.json is missing")
            files[shard] = SafetensorsFile(p)
        for name, shard in wm.items():
            if name not in files[shard].tensors:
                raise AWQError(f"{root / shard}: has no tensor {name!r} (model.safetensors.index.json says it does)")
            where[name] = files[shard]
    else:
        paths = sorted(root.glob("*.safetensors"))
        if not paths:
            raise AWQError(f"{root}: no *.safetensors weights in the folder")
        for p in paths:
            f = SafetensorsFile(p)
            for name in f.tensors:
                where.setdefault(name, f)
    return where


# ---------------------------------------------------------------------------------------------------- config
def _read_json(path: Path, required: bool = True) -> dict:
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
        raise AWQError(f"{src}: quantization_config.modules_to_not_convert = {_short(skip)} is not a list of "
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
            raise AWQError(f"{source}: {key} = {_short(v)} is not an integer in [{lo}, {hi}]")
        return v

    def get_float(key, default, hi=float("inf"), where=None):
        v = (text if where is None else where).get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= hi:
            bound = f" and <= {hi:g}" if hi < float("inf") else ""
            label = key if where is None else f"rope scaling {key}"
            raise AWQError(f"{source}: {label} = {_short(v)} is not a finite number > 0{bound}")
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


# ---------------------------------------------------------------------------------------------------- names
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
    where = _open_shards(root)
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


# ---------------------------------------------------------------------------------------------------- tokenizer
def _token_str(v) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def tokenizer_from_hf(root: Path, n_vocab_model: int):
    """pyllm's Tokenizer over tokenizer.json (tokenizers library), with tokenizer_config / generation_config ids."""
    from tokenizers import Tokenizer as HFTok

    from .tokenizer import BYTE, CONTROL, NORMAL, UNUSED, USER_DEFINED, _EOG_TEXTS, Tokenizer

    path = root / "tokenizer.json"
    if not os.path.lexists(path):
        raise TokenizerError(f"{root}: tokenizer.json is missing (needed for the vocabulary)")
    spec = read_json(path, TokenizerError)
    try:
        backend = HFTok.from_str(json.dumps(spec))
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise TokenizerError(f"{path}: cannot be loaded ({str(e).splitlines()[0] if str(e) else type(e).__name__})") \
            from None
    tc = _read_json(root / "tokenizer_config.json", required=False)
    gc = _read_json(root / "generation_config.json", required=False)
    n = backend.get_vocab_size(with_added_tokens=True)
    tokens = [backend.id_to_token(i) or "" for i in range(n)]
    model = spec.get("model") or {}
    dec = json.dumps(spec.get("decoder") or {})
    spm = bool(model.get("byte_fallback")) or "\u2581" in dec or "Metaspace" in dec
    types = [NORMAL] * n
    if spm:
        for i, t in enumerate(tokens):
            if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t):
                types[i] = BYTE
    for at in spec.get("added_tokens") or []:
        i = at.get("id")
        if isinstance(i, int) and 0 <= i < n:
            types[i] = CONTROL if at.get("special") else USER_DEFINED

    def tid(v):
        s = _token_str(v)
        return backend.token_to_id(s) if s is not None else None

    bos_id = tid(tc.get("bos_token"))
    eos_id = tid(tc.get("eos_token"))
    if bos_id is None and isinstance(gc.get("bos_token_id"), int) and tc.get("bos_token", 0) is not None:
        bos_id = gc["bos_token_id"]
        if not 0 <= bos_id < n:
            raise TokenizerError(f"{root / 'generation_config.json'}: bos_token_id {bos_id} is not in the "
                                 f"vocabulary of {n} tokens")
    eog = set()
    ge = gc.get("eos_token_id")
    for e in (ge if isinstance(ge, list) else [ge]):
        if isinstance(e, int) and 0 <= e < n:
            eog.add(e)
    if eos_id is None and eog:
        eos_id = min(eog)
    if eos_id is not None:
        eog.add(eos_id)
    for t in _EOG_TEXTS:
        i = backend.token_to_id(t)
        if i is not None and types[i] == CONTROL:
            eog.add(i)
    # add BOS as transformers would: the config's flag, else whatever the post-processor does
    add_bos = tc.get("add_bos_token")
    if add_bos is not None and not isinstance(add_bos, bool):
        raise TokenizerError(f"{root / 'tokenizer_config.json'}: add_bos_token = {_short(add_bos)} is not true or "
                             f"false")
    if add_bos is None:
        with_sp = backend.encode("a", add_special_tokens=True).ids
        add_bos = bool(bos_id is not None and with_sp and with_sp[0] == bos_id)
    add_bos = bool(add_bos) and bos_id is not None
    if spm:
        # pyllm's SPM encoder inserts the prefix space and the U+2581 escapes itself
        backend.normalizer = None
        backend.pre_tokenizer = None
    backend.post_processor = None
    try:
        backend.encode_special_tokens = True  # pyllm cuts special tokens out itself (or keeps them as text)
    except AttributeError:
        pass
    if n < n_vocab_model:  # embedding rows beyond the vocabulary (padding): decode to nothing
        tokens += [""] * (n_vocab_model - n)
        types += [UNUSED] * (n_vocab_model - n)
    tok = Tokenizer(kind="spm" if spm else "bpe", tokens=tokens, types=types, backend=backend, bos_id=bos_id,
                    eos_id=eos_id, eog_ids=eog, add_bos=add_bos, add_eos=False, add_space_prefix=spm)
    return tok


def chat_template_source(root: Path) -> str | None:
    tc = _read_json(root / "tokenizer_config.json", required=False)
    src = tc.get("chat_template")
    if isinstance(src, list):  # [{"name": "default", "template": ...}, ...]
        src = next((t.get("template") for t in src if isinstance(t, dict) and t.get("name") == "default"), None)
    if src is not None and not isinstance(src, str):
        raise AWQError(f"{root / 'tokenizer_config.json'}: chat_template = {_short(src)} is not a string")
    if src is None:
        jinja = root / "chat_template.jinja"
        raw = read_regular(jinja, 1 << 20, AWQError) if os.path.lexists(jinja) else None
        try:
            src = raw.decode("utf-8") if raw is not None else None
        except UnicodeDecodeError as e:
            raise AWQError(f"{jinja}: the chat template is not UTF-8 text (byte {raw[e.start]:#04x} at offset "
                           f"{e.start})") from None
    return src if src and src.strip() else None


# ---------------------------------------------------------------------------------------------------- loading
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
    hf = _read_json(root / "config.json")
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
    """An AWQ folder as a Checkpoint (pyllm/checkpoint.py): what pyllm.load turns into the same LLM and the same
    decoder as a GGUF file. Its int4 tensors stay in checkpoint form here; the backend lays them out."""
    import sys

    from .chat_template import ChatTemplate
    from .checkpoint import Checkpoint
    from .models import model_class

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
    from .info import model_info

    info, cfg, _ = open_awq(path)
    out = model_info(info, cfg, n_ctx=n_ctx, kv_kind=kv_kind)
    out["file_bytes"] = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
    out["quantization"] = f"AWQ gemm, 4-bit, group size {info.quant['group_size']}"
    tj = Path(path) / "tokenizer.json"
    out["tokenizer"] = "tokenizer.json" if tj.is_file() else "missing (tokenizer.json)"
    return out
