"""KV cache kinds as names and sizes: which kinds exist, how a "K/V" kind splits, what a head_dim needs and what a
position costs in bytes.  Plain arithmetic without torch, so that describing a model (`pyllm info`) and checking a
command line's --kv start without it; runtime/kv_cache.py stores the kinds (its module docstring says how)."""

from __future__ import annotations

from ..errors import PyllmError, shorten

FLOAT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}  # the float kinds, bytes per value
QK = 32  # values per quantization block (llama.cpp's QK8_0 / QK4_0)
# bytes per block of 32 values: q8_0 = fp16 scale + 32 int8; q4_0 = fp16 scale + 16 bytes of nibbles
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_rot": 18, "q8_rot": 34}
ROTATED = ("q4_rot", "q8_rot")
KV_KINDS = tuple(FLOAT_BYTES) + tuple(BLOCK_BYTES)


def split_kind(kind: str) -> tuple[str, str]:
    """"q8_0" -> ("q8_0", "q8_0"); "f16/q8_0" -> ("f16", "q8_0") (key type, value type). Raises on unknown types."""
    parts = kind.split("/") if isinstance(kind, str) else [kind]
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or any(p not in KV_KINDS for p in parts):
        raise PyllmError(f"unknown KV cache type {shorten(kind)!r}; choose one of: {', '.join(KV_KINDS)} "
                         f"(or KEY/VALUE such as f16/q8_0)")
    return parts[0], parts[1]


def join_kind(k_kind: str, v_kind: str) -> str:
    """The kind string of a cache with these key and value types ("q8_0" when both are q8_0)."""
    split_kind(f"{k_kind}/{v_kind}")
    return k_kind if k_kind == v_kind else f"{k_kind}/{v_kind}"


def bytes_per_value(kind: str) -> float:
    """Mean bytes per cached value (keys and values together)."""
    return sum(FLOAT_BYTES[p] if p in FLOAT_BYTES else BLOCK_BYTES[p] / QK for p in split_kind(kind)) / 2


def bytes_per_token(n_layer: int, n_kv_head: int, head_dim: int, kind: str = "f16") -> float:
    """K and V bytes one position takes in every layer (scales included for the block kinds)."""
    return 2.0 * n_layer * n_kv_head * head_dim * bytes_per_value(kind)


def check_kind(kind: str, head_dim: int) -> None:
    """Raises PyllmError if ``kind`` is unknown or cannot store heads of ``head_dim`` values."""
    for p in split_kind(kind):
        if p in BLOCK_BYTES and head_dim % QK:
            raise PyllmError(f"KV cache type {p} needs head_dim to be a multiple of {QK}; this model has {head_dim}")
        if p in ROTATED and head_dim & (head_dim - 1):
            raise PyllmError(f"KV cache type {p} needs head_dim to be a power of two; this model has {head_dim}")
