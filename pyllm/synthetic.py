"""Writers for small synthetic GGUF files: test inputs (good and deliberately broken) and tiny random models.

Three levels:
- ``gguf_bytes``: serialize exactly the header fields given, no checks. For bad-input tests (duplicate names,
  overlapping offsets, wrong counts, unknown type ids...).
- ``write_gguf``: a valid file from a metadata dict and a tensor dict, data laid out and aligned.
- ``write_tiny_llama``: a random llama-family model (llama / qwen2 layout) with a byte-level BPE vocabulary.

``random_blocks`` makes valid random quantized blocks (random codes, finite fp16 scales) for any compute type.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pyllm.formats.gguf import BLOCK_INFO, COMPUTE_TYPES, DEFAULT_ALIGNMENT, GGMLType, ValueType

# Byte offsets of the fp16 scale/min fields inside one block: random bytes there could be inf/NaN.
SCALE_OFFSETS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
    GGMLType.IQ4_NL: (0,),
    GGMLType.IQ4_XS: (0,),
    GGMLType.MXFP4: (),  # its scale is an E8M0 byte (random_blocks sets it), not an fp16 field
}
# Largest |code x sub-scale| a block can hold, so a scale of amplitude / MAX_CODE keeps values within amplitude.
MAX_CODE: dict[GGMLType, float] = {
    GGMLType.Q4_0: 8, GGMLType.Q4_1: 15, GGMLType.Q5_0: 16, GGMLType.Q5_1: 31, GGMLType.Q8_0: 128,
    GGMLType.Q2_K: 45, GGMLType.Q3_K: 128, GGMLType.Q4_K: 945, GGMLType.Q5_K: 1953, GGMLType.Q6_K: 4096,
    GGMLType.IQ4_NL: 127, GGMLType.IQ4_XS: 32 * 127,
}  # fmt: skip
_FLOAT_NP = {GGMLType.F32: np.float32, GGMLType.F16: np.float16}
# Types that write_gguf can build from float values (gguf-py has quantizers for these).
_QUANTIZABLE = frozenset(
    {GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
     GGMLType.Q8_0}
)  # fmt: skip


def random_blocks(qtype: GGMLType, n_blocks: int, rng: np.random.Generator | None = None, amplitude: float = 1.0):
    """Random valid blocks -> uint8 [n_blocks, type_size].

    Quant codes are random bytes; every fp16 scale/min is finite, uniform in +-amplitude/MAX_CODE, so values stay
    within about +-amplitude. Float types get normal(0, amplitude/3) values.
    """
    rng = rng if rng is not None else np.random.default_rng(0)
    qtype = GGMLType(qtype)
    if qtype not in COMPUTE_TYPES:
        raise ValueError(f"random_blocks: no layout for {qtype.name}")
    _, ts = BLOCK_INFO[qtype]
    if qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        v = (rng.standard_normal(n_blocks) * (amplitude / 3)).astype(np.float32)
        if qtype == GGMLType.BF16:
            return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_blocks, ts)
        return v.astype(_FLOAT_NP[qtype]).view(np.uint8).reshape(n_blocks, ts)
    b = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    if qtype == GGMLType.MXFP4:  # an E8M0 exponent: values kvalue (|.| <= 12) * 2^(e - 128), within +-amplitude
        top = int(np.floor(np.log2(amplitude / 12.0))) + 128
        b[:, 0] = rng.integers(max(top - 4, 2), max(top, 2) + 1, size=n_blocks)
        return b
    for off in SCALE_OFFSETS[qtype]:
        s = rng.uniform(-1.0, 1.0, n_blocks) * (amplitude / MAX_CODE[qtype])
        b[:, off : off + 2] = s.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return b


def quantize(qtype: GGMLType, values: np.ndarray) -> np.ndarray:
    """float values [..., K] -> raw bytes uint8 [..., K / block_size * type_size] (gguf-py's quantizers).

    Only types gguf-py can quantize (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); use random_blocks otherwise.
    """
    qtype = GGMLType(qtype)
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype in _FLOAT_NP:
        return values.astype(_FLOAT_NP[qtype]).view(np.uint8)
    import gguf.quants  # the test oracle; only needed to build files

    try:
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType(int(qtype)))
    except NotImplementedError:
        raise ValueError(f"gguf-py cannot quantize {qtype.name}; pass raw blocks (random_blocks)") from None


# -- serialization -------------------------------------------------------------------------------------------


class Typed(NamedTuple):
    """A metadata value with an explicit GGUF type (``elem`` is the element type of an ARRAY)."""

    vtype: ValueType
    value: Any
    elem: ValueType | None = None


_PACK = {
    ValueType.UINT8: "<B", ValueType.INT8: "<b", ValueType.UINT16: "<H", ValueType.INT16: "<h",
    ValueType.UINT32: "<I", ValueType.INT32: "<i", ValueType.FLOAT32: "<f", ValueType.BOOL: "<B",
    ValueType.UINT64: "<Q", ValueType.INT64: "<q", ValueType.FLOAT64: "<d",
}  # fmt: skip
_NP = {
    ValueType.UINT8: "<u1", ValueType.INT8: "<i1", ValueType.UINT16: "<u2", ValueType.INT16: "<i2",
    ValueType.UINT32: "<u4", ValueType.INT32: "<i4", ValueType.FLOAT32: "<f4", ValueType.BOOL: "<u1",
    ValueType.UINT64: "<u8", ValueType.INT64: "<i8", ValueType.FLOAT64: "<f8",
}  # fmt: skip


def _infer(value: Any) -> Typed:
    if isinstance(value, Typed):
        return value
    if isinstance(value, bool):
        return Typed(ValueType.BOOL, value)
    if isinstance(value, int):
        if 0 <= value < 2**32:
            return Typed(ValueType.UINT32, value)
        if -(2**31) <= value < 0:
            return Typed(ValueType.INT32, value)
        return Typed(ValueType.INT64 if value < 0 else ValueType.UINT64, value)
    if isinstance(value, float):
        return Typed(ValueType.FLOAT32, value)
    if isinstance(value, (str, bytes)):
        return Typed(ValueType.STRING, value)
    if isinstance(value, (list, tuple, np.ndarray)):
        value = list(value)
        elem = _infer(value[0]).vtype if value else ValueType.INT32
        if elem == ValueType.UINT32 and any(isinstance(v, int) and v < 0 for v in value):
            elem = ValueType.INT32
        return Typed(ValueType.ARRAY, value, elem)
    raise TypeError(f"cannot store {type(value).__name__} in GGUF metadata")


def _string(s: str | bytes) -> bytes:
    b = s if isinstance(s, bytes) else s.encode("utf-8", "surrogateescape")
    return struct.pack("<Q", len(b)) + b


def _value(t: Typed) -> bytes:
    if t.vtype == ValueType.STRING:
        return _string(t.value)
    if t.vtype == ValueType.ARRAY:
        elem = t.elem if t.elem is not None else _infer(list(t.value)).elem
        head = struct.pack("<IQ", elem, len(t.value))
        if elem in _NP:
            return head + np.asarray(t.value).astype(_NP[elem]).tobytes()
        if elem == ValueType.STRING:
            return head + b"".join(_string(s) for s in t.value)
        return head + b"".join(_value(_infer(v) if not isinstance(v, Typed) else v) for v in t.value)
    return struct.pack(_PACK[t.vtype], t.value)


def gguf_bytes(
    kvs: list[tuple[str, Typed | Any]],
    tensor_infos: list[tuple[str, tuple[int, ...], int, int]],
    data: bytes = b"",
    *,
    version: int = 3,
    alignment: int = DEFAULT_ALIGNMENT,
    magic: bytes = b"GGUF",
    tensor_count: int | None = None,
    kv_count: int | None = None,
) -> bytes:
    """Serialize a GGUF file exactly as told, with no validation (for building broken inputs).

    ``kvs``: (key, value or Typed) in order, duplicates allowed. ``tensor_infos``: (name, ne in ggml order,
    ggml type id, offset relative to the data section). The header is padded to ``alignment``, then ``data``.
    ``tensor_count``/``kv_count`` override the counts written.
    """
    out = bytearray(magic)
    out += struct.pack("<IQQ", version, len(tensor_infos) if tensor_count is None else tensor_count,
                       len(kvs) if kv_count is None else kv_count)  # fmt: skip
    for key, v in kvs:
        t = _infer(v)
        out += _string(key) + struct.pack("<I", t.vtype) + _value(t)
    for name, ne, type_id, offset in tensor_infos:
        out += _string(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        out += struct.pack("<IQ", type_id, offset)
    out += b"\0" * (-len(out) % alignment)
    return bytes(out + data)


def tensor_bytes(qtype: GGMLType, array: np.ndarray, shape: tuple[int, ...]) -> bytes:
    """One tensor's data: uint8 arrays are taken as raw blocks, float arrays are converted/quantized."""
    qtype = GGMLType(qtype)
    bs, ts = BLOCK_INFO[qtype]
    if shape[-1] % bs:
        raise ValueError(f"shape {shape}: last dimension is not a multiple of the {qtype.name} block size {bs}")
    n = int(np.prod(shape)) // bs * ts
    a = np.asarray(array)
    if a.dtype == np.uint8:
        raw = a.tobytes()
    elif qtype == GGMLType.BF16:
        raw = (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    else:
        raw = quantize(qtype, a.reshape(-1, shape[-1])).tobytes()
    if len(raw) != n:
        raise ValueError(f"{qtype.name} shape {shape} needs {n} bytes of data, got {len(raw)}")
    return raw


def write_gguf(
    path: str | os.PathLike,
    metadata: dict[str, Any],
    tensors: dict[str, tuple[GGMLType, np.ndarray, tuple[int, ...]]],
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    version: int = 3,
) -> Path:
    """Write a valid GGUF file. Returns its path.

    ``metadata``: key -> value; Python types map to GGUF types (int -> UINT32, or INT32/INT64/UINT64 when out of
    range; float -> FLOAT32; lists -> arrays of the first element's type); wrap in ``Typed`` to choose.
    ``tensors``: name -> (GGMLType, data, shape in torch order). ``data`` is raw blocks (uint8, any shape) or float
    values (converted/quantized with gguf-py). ``general.alignment`` is written when ``alignment`` is not 32.
    """
    kvs = list(metadata.items())
    if alignment != DEFAULT_ALIGNMENT and "general.alignment" not in metadata:
        kvs.insert(0, ("general.alignment", Typed(ValueType.UINT32, alignment)))
    infos, chunks, offset = [], [], 0
    for name, (qtype, array, shape) in tensors.items():
        raw = tensor_bytes(qtype, array, tuple(shape))
        infos.append((name, tuple(reversed(shape)), int(qtype), offset))
        pad = -len(raw) % alignment
        chunks.append(raw + b"\0" * pad)
        offset += len(raw) + pad
    blob = gguf_bytes(kvs, infos, b"".join(chunks), version=version, alignment=alignment)
    path = Path(path)
    path.write_bytes(blob)
    return path


# -- a tiny random model ---------------------------------------------------------------------------------------

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_level_chars() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable stand-in for each byte, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_vocab(n_vocab: int) -> dict[str, Any]:
    """Byte-level BPE ("gpt2") tokenizer metadata with exactly ``n_vocab`` tokens (>= 300).

    256 byte tokens, a few merges, the ChatML specials (control tokens), then filler control tokens.
    """
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_tokens = _byte_level_chars()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "Ġ w"]
    merged = [m.replace(" ", "") for m in merges]
    if n_vocab < 256 + len(merged) + len(specials):
        raise ValueError(f"tiny_vocab: n_vocab must be at least {256 + len(merged) + len(specials)}")
    fill = n_vocab - 256 - len(merged) - len(specials)
    tokens = byte_tokens + merged + [f"<|extra_{i}|>" for i in range(fill)] + specials
    types = [1] * (256 + len(merged)) + [3] * (fill + len(specials))  # 1 normal, 3 control
    eos = n_vocab - 1  # <|im_end|>: ends a chat turn
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": Typed(ValueType.ARRAY, types, ValueType.INT32),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": n_vocab - 3,
        "tokenizer.ggml.eos_token_id": eos,
        "tokenizer.ggml.padding_token_id": n_vocab - 3,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }


def write_tiny_llama(
    path: str | os.PathLike,
    *,
    arch: str = "llama",
    qtype: GGMLType = GGMLType.Q8_0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_ff: int = 128,
    n_head: int = 4,
    n_kv_head: int = 2,
    n_vocab: int = 320,
    n_ctx: int = 256,
    rope_base: float = 10000.0,
    rms_eps: float = 1e-5,
    tied: bool = False,
    qkv_bias: bool | None = None,
    seed: int = 0,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """A random llama-family model file (llama.cpp tensor names and metadata keys). Returns its path.

    Every matrix is ``qtype`` (float weights ~N(0, 0.05) quantized with gguf-py where it can, otherwise
    random_blocks with values within +-0.1); norms are F32 near 1. ``arch="qwen2"`` adds q/k/v biases
    (``qkv_bias`` overrides). ``tied`` omits output.weight. ``metadata`` entries are added/override.
    K dimensions (n_embd, n_ff, n_head * head_dim) must be multiples of the qtype block size.
    """
    qtype = GGMLType(qtype)
    rng = np.random.default_rng(seed)
    if n_embd % n_head or n_head % n_kv_head:
        raise ValueError("n_embd must divide by n_head, and n_head by n_kv_head")
    hd = n_embd // n_head
    bs = BLOCK_INFO[qtype][0]
    for what, k in (("n_embd", n_embd), ("n_ff", n_ff)):
        if k % bs:
            raise ValueError(f"{what}={k} is not a multiple of the {qtype.name} block size {bs}")
    bias = (arch == "qwen2") if qkv_bias is None else qkv_bias

    def mat(n: int, k: int):
        if qtype in _QUANTIZABLE:
            return (qtype, (rng.standard_normal((n, k)) * 0.05).astype(np.float32), (n, k))
        return (qtype, random_blocks(qtype, n * k // bs, rng, amplitude=0.1), (n, k))

    def norm(k: int):
        return (GGMLType.F32, (1.0 + 0.1 * rng.standard_normal(k)).astype(np.float32), (k,))

    def vec(k: int):
        return (GGMLType.F32, (0.02 * rng.standard_normal(k)).astype(np.float32), (k,))

    tensors: dict[str, tuple] = {"token_embd.weight": mat(n_vocab, n_embd), "output_norm.weight": norm(n_embd)}
    if not tied:
        tensors["output.weight"] = mat(n_vocab, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = norm(n_embd)
        tensors[p + "attn_q.weight"] = mat(n_head * hd, n_embd)
        tensors[p + "attn_k.weight"] = mat(n_kv_head * hd, n_embd)
        tensors[p + "attn_v.weight"] = mat(n_kv_head * hd, n_embd)
        if bias:
            tensors[p + "attn_q.bias"] = vec(n_head * hd)
            tensors[p + "attn_k.bias"] = vec(n_kv_head * hd)
            tensors[p + "attn_v.bias"] = vec(n_kv_head * hd)
        tensors[p + "attn_output.weight"] = mat(n_embd, n_head * hd)
        tensors[p + "ffn_norm.weight"] = norm(n_embd)
        tensors[p + "ffn_gate.weight"] = mat(n_ff, n_embd)
        tensors[p + "ffn_up.weight"] = mat(n_ff, n_embd)
        tensors[p + "ffn_down.weight"] = mat(n_embd, n_ff)

    md: dict[str, Any] = {
        "general.architecture": arch,
        "general.name": f"tiny-{arch}-{qtype.name.lower()}",
        f"{arch}.context_length": n_ctx,
        f"{arch}.embedding_length": n_embd,
        f"{arch}.block_count": n_layer,
        f"{arch}.feed_forward_length": n_ff,
        f"{arch}.attention.head_count": n_head,
        f"{arch}.attention.head_count_kv": n_kv_head,
        f"{arch}.attention.layer_norm_rms_epsilon": float(rms_eps),
        f"{arch}.rope.freq_base": float(rope_base),
        f"{arch}.rope.dimension_count": hd,
        f"{arch}.vocab_size": n_vocab,
    }
    md.update(tiny_vocab(n_vocab))
    md.update(metadata or {})
    return write_gguf(path, md, tensors)
