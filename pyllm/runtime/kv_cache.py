"""The KV cache: one preallocated buffer per model, written at a position and read up to a length.

Kinds (``make_kv_cache(kind, ...)``, ``pyllm.load(kv_cache=kind)``, ``--kv kind``):

=======  =============  ==================================================================================
kind     bits/value     storage
=======  =============  ==================================================================================
f32      32             plain tensors
f16      16             plain tensors (the default)
bf16     16             plain tensors
q8_0     8.5            llama.cpp's q8_0: blocks of 32 along head_dim, int8 values + one fp16 scale
q4_0     4.5            llama.cpp's q4_0: blocks of 32 along head_dim, 4-bit values + one fp16 scale
q4_rot   4.5            q4_0 of each head vector, centered and rotated (randomized Hadamard)
=======  =============  ==================================================================================

Every kind has the same interface: ``update(layer, pos, k, v)`` stores (quantizes) new positions, ``view(layer,
upto)`` returns float K/V in the model's basis (dequantized), and ``attend(layer, q, start_pos, attn)`` runs the
model's attention over the cache's own storage -- the rotated kind attends in its rotated basis, so the rotation
costs O(T * head_dim^2) per step instead of O(S * head_dim^2) for un-rotating the whole cache.

Why the rotation works (q4_rot). Let R = H D / sqrt(n), with H the n x n Sylvester-Hadamard matrix (entries +-1,
n = head_dim, a power of two) and D a fixed diagonal of random signs; R R^T = I. Vectors are rows here, so a head
vector x is stored as x R^T.
  * Scores: (q R^T) . (k R^T) = q R^T R k^T = q . k, so rotating Q the same way leaves softmax(q K^T) unchanged.
  * Values: the output o = sum_j p_j v_j is linear in V, so attending over rotated values gives o R^T, and
    (o R^T) R = o un-rotates it.
  * Offsets: keys and values are stored minus a fixed per-(layer, head) mean mu. For one query, q.(k_j - mu_k) =
    q.k_j - q.mu_k shifts every score by the same constant, which softmax ignores (masking keeps only keys of the
    same query, so it is still one constant per row); and sum_j p_j (v_j - mu_v) = o - mu_v because the weights
    sum to 1, so adding mu_v back to the output is exact. Removing the mean matters: RoPE leaves the slow channels
    of K with a large common component (Qwen2's K bias is huge), which otherwise sets the 4-bit step of every block.
  * Quantization: each rotated coordinate is a +-1/sqrt(n)-weighted sum of all n coordinates, so a few outlier
    channels (RoPE'd keys and Qwen's K bias have them) are spread over the whole vector. The block absmax then
    tracks the vector's RMS instead of its outliers, and the 4-bit step (absmax / 8) shrinks accordingly. The
    error is committed in the rotated basis; R is orthogonal, so its L2 norm per vector is the same after
    un-rotating. The random signs keep structured vectors (e.g. one aligned with a row of H) from staying peaky.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from ..errors import PyllmError

KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
QK = 32  # values per quantization block (llama.cpp's QK8_0 / QK4_0)
# bytes per block of 32 values: q8_0 = 32 int8 + fp16 scale; q4_0 = 16 bytes of nibbles + fp16 scale
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_rot": 18}
KV_KINDS = tuple(KV_DTYPES) + tuple(BLOCK_BYTES)

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (q [T,H,hd], k, v [Hkv,S,hd])


def bytes_per_value(kind: str) -> float:
    if kind in KV_DTYPES:
        return float(torch.empty((), dtype=KV_DTYPES[kind]).element_size())
    if kind in BLOCK_BYTES:
        return BLOCK_BYTES[kind] / QK
    raise PyllmError(f"unknown KV cache type {kind!r}; choose one of: {', '.join(KV_KINDS)}")


def check_kind(kind: str, head_dim: int) -> None:
    """Raises PyllmError if ``kind`` is unknown or cannot store heads of ``head_dim`` values."""
    bytes_per_value(kind)
    if kind in BLOCK_BYTES and head_dim % QK:
        raise PyllmError(f"KV cache type {kind} needs head_dim to be a multiple of {QK}; this model has {head_dim}")
    if kind == "q4_rot" and head_dim & (head_dim - 1):
        raise PyllmError(f"KV cache type q4_rot needs head_dim to be a power of two; this model has {head_dim}")


class KVCache:
    """Keys and values of every layer for up to ``max_seq`` positions.

    k, v: (n_layer, n_kv_head, max_seq, head_dim) in ``dtype``. Positions past the valid length hold stale values;
    the runtime tracks the valid length, so truncating the cache (prefix reuse) costs nothing.
    """

    kind = "f16"

    def __init__(self, n_layer: int, n_kv_head: int, max_seq: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu"):
        self.n_layer, self.n_kv_head, self.max_seq, self.head_dim = n_layer, n_kv_head, max_seq, head_dim
        self.dtype = dtype
        shape = (n_layer, n_kv_head, max_seq, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(n_layer: int, n_kv_head: int, head_dim: int, kind: str = "f16") -> float:
        """K and V bytes one position takes in every layer (scales included for the block kinds)."""
        return 2.0 * n_layer * n_kv_head * head_dim * bytes_per_value(kind)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers())

    def _buffers(self) -> list[torch.Tensor]:
        return [self.k, self.v]

    def _check(self, pos: int, t: int) -> None:
        if pos < 0 or pos + t > self.max_seq:
            raise PyllmError(f"KV cache holds {self.max_seq} positions; cannot write {t} at position {pos}")

    def update(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v: (T, n_kv_head, head_dim) at positions pos..pos+T-1 of ``layer``."""
        t = k.shape[0]
        self._check(pos, t)
        self.k[layer, :, pos:pos + t] = k.transpose(0, 1).to(self.dtype)
        self.v[layer, :, pos:pos + t] = v.transpose(0, 1).to(self.dtype)

    def view(self, layer: int, upto: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions 0..upto-1 as (n_kv_head, upto, head_dim) in ``dtype`` (a copy unless dtype matches)."""
        return (self.k[layer, :, :upto].to(dtype), self.v[layer, :, :upto].to(dtype))

    def attend(self, layer: int, q: torch.Tensor, start_pos: int, attn: Attention) -> torch.Tensor:
        """Attention of q [T, H, hd] (positions start_pos..) over cached positions 0..start_pos+T-1.

        ``attn(q, k, v)`` is the model's attention (mask, scale and window bound in) and returns [T, H*hd].
        """
        k, v = self.view(layer, start_pos + q.shape[0])
        return attn(q, k, v)


class BlockQuantKVCache(KVCache):
    """Shared storage of the block kinds: per (layer, K|V, head, position) head_dim/32 blocks, one fp16 scale each.

    codes: (n_layer, 2, n_kv_head, max_seq, nb, code_width); scales: (n_layer, 2, n_kv_head, max_seq, nb) fp16,
    nb = head_dim/32, index 0 = K, 1 = V. K and V share one tensor so a decode step quantizes and dequantizes
    them in one pass each: at one token per step the cost is op dispatch, not arithmetic.
    Subclasses define ``_quantize(x [..., nb, 32] f32) -> (codes, scales f16 [..., nb])`` and
    ``_dequantize(codes, scales) -> [..., nb, 32] f32``.
    """

    code_shape: tuple[int, ...] = ()
    code_dtype = torch.int8

    def __init__(self, n_layer: int, n_kv_head: int, max_seq: int, head_dim: int,
                 device: str | torch.device = "cpu"):
        check_kind(self.kind, head_dim)
        self.n_layer, self.n_kv_head, self.max_seq, self.head_dim = n_layer, n_kv_head, max_seq, head_dim
        self.dtype = None  # no float storage dtype: see kind
        lead = (n_layer, 2, n_kv_head, max_seq, head_dim // QK)
        self.codes = torch.zeros(lead + self.code_shape, dtype=self.code_dtype, device=device)
        self.scales = torch.zeros(lead, dtype=torch.float16, device=device)

    def _buffers(self) -> list[torch.Tensor]:
        return [self.codes, self.scales]

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        """Model basis -> storage basis (identity here; the rotated kind overrides it). x: [..., hd] f32."""
        return x

    def update(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        t = k.shape[0]
        self._check(pos, t)
        kv = torch.stack((k, v)).float().transpose(1, 2)  # [2, Hkv, T, hd]
        c, d = self._quantize(self._store(kv).reshape(2, self.n_kv_head, t, self.head_dim // QK, QK))
        self.codes[layer, :, :, pos:pos + t] = c
        self.scales[layer, :, :, pos:pos + t] = d

    def _stored(self, layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V in the storage basis: (Hkv, upto, hd) float32 each."""
        x = self._dequantize(self.codes[layer, :, :, :upto], self.scales[layer, :, :, :upto])
        x = x.view(2, self.n_kv_head, upto, self.head_dim)
        return x[0], x[1]

    def view(self, layer: int, upto: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._stored(layer, upto)
        return k.to(dtype), v.to(dtype)

    def attend(self, layer: int, q: torch.Tensor, start_pos: int, attn: Attention) -> torch.Tensor:
        k, v = self._stored(layer, start_pos + q.shape[0])
        return attn(q, k, v)


def _round_away(x: torch.Tensor) -> torch.Tensor:
    # C's roundf (half away from zero), which llama.cpp uses; torch.round rounds half to even
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


class Q8_0KVCache(BlockQuantKVCache):
    """llama.cpp q8_0: d = absmax / 127, q = roundf(x / d) in [-127, 127], x ~ q * d.

    Round-trip error per value <= d/2 plus the fp16 rounding of d (relative 2^-11, times |q| <= 127).
    """

    kind = "q8_0"
    code_shape = (QK,)
    code_dtype = torch.int8

    @staticmethod
    def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = x.abs().amax(-1) / 127.0  # [..., nb]
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = _round_away(x * inv[..., None]).to(torch.int8)
        return q, d.to(torch.float16)

    @staticmethod
    def _dequantize(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return q.to(torch.float32).mul_(d.to(torch.float32).unsqueeze(-1))


class Q4_0KVCache(BlockQuantKVCache):
    """llama.cpp q4_0: d = m / -8 with m the value of largest magnitude (sign kept), q = min(15, floor(x/d + 8.5)),
    x ~ (q - 8) * d. Codes pack two per byte as llama.cpp does: byte j holds value j (low nibble) and j + 16 (high).

    Round-trip error per value <= |d|/2, except values of the sign opposite to m near +|m|, which clamp at q = 15:
    <= |d| = absmax/8 (plus the fp16 rounding of d).
    """

    kind = "q4_0"
    code_shape = (QK // 2,)
    code_dtype = torch.uint8

    @staticmethod
    def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = x.abs().argmax(-1, keepdim=True)  # the first of equal magnitudes, like llama.cpp's strict '<'
        m = x.gather(-1, idx).squeeze(-1)
        d = m / -8.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.floor(x * inv[..., None] + 8.5).clamp_(0, 15).to(torch.uint8)  # [..., nb, 32]
        packed = q[..., :QK // 2] | (q[..., QK // 2:] << 4)
        return packed, d.to(torch.float16)

    @staticmethod
    def _dequantize(packed: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        # cat + in-place int8 subtract + one float pass: the cheapest of the torch spellings measured
        q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).view(torch.int8).sub_(8)  # [..., nb, 32] in -8..7
        return q.to(torch.float32).mul_(d.to(torch.float32).unsqueeze(-1))


@functools.lru_cache(maxsize=None)
def hadamard_rotation(n: int, signs_seed: int | None = 0) -> torch.Tensor:
    """R = H D / sqrt(n), float32 [n, n], orthogonal. H: Sylvester-Hadamard; D: fixed random signs (seeded, so
    every process stores the same basis), or none when signs_seed is None."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    if signs_seed is not None:
        g = torch.Generator().manual_seed(signs_seed)
        s = torch.randint(0, 2, (n,), generator=g, dtype=torch.float64) * 2 - 1
        h = h * s[None, :]  # H D: scales column j by s_j
    return (h / n ** 0.5).float()


class Q4RotKVCache(Q4_0KVCache):
    """q4_0 storage of centered, rotated head vectors: stores (k - mu_k) R^T and (v - mu_v) R^T.

    mu: (n_layer, 2, n_kv_head, head_dim) float32, one mean key and value per layer and head, estimated from the
    first batch written at position 0 (without position 0 itself, often an attention-sink outlier) and then
    fixed. See the module docstring for why neither the rotation nor the offsets change attention.
    """

    kind = "q4_rot"

    def __init__(self, n_layer: int, n_kv_head: int, max_seq: int, head_dim: int,
                 device: str | torch.device = "cpu"):
        super().__init__(n_layer, n_kv_head, max_seq, head_dim, device)
        self.rot = hadamard_rotation(head_dim).to(device)  # R [hd, hd]
        self.rot_t = self.rot.T.contiguous()  # R^T: x R^T rotates a row vector x
        self.mu = torch.zeros(n_layer, 2, n_kv_head, 1, head_dim, device=device)
        self.mu_set = [False] * n_layer  # False while the layer holds position 0 alone (or nothing)

    def _buffers(self) -> list[torch.Tensor]:
        return [self.codes, self.scales, self.mu]

    def _write(self, layer: int, pos: int, kv: torch.Tensor) -> None:
        """kv: [2, Hkv, T, hd] f32 in the model basis -> codes/scales at pos.. of ``layer``."""
        t = kv.shape[2]
        x = (kv - self.mu[layer]) @ self.rot_t
        c, d = self._quantize(x.reshape(2, self.n_kv_head, t, self.head_dim // QK, QK))
        self.codes[layer, :, :, pos:pos + t] = c
        self.scales[layer, :, :, pos:pos + t] = d

    def update(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        t = k.shape[0]
        self._check(pos, t)
        kv = torch.stack((k, v)).float().transpose(1, 2)  # [2, Hkv, T, hd]
        if pos == 0:
            self.mu_set[layer] = False  # the cache is being rewritten from the start: estimate again
            self.mu[layer].zero_()
        if not self.mu_set[layer] and pos + t >= 2:
            old = self.view(layer, pos) if pos else None  # position 0, stored before there was a mean
            skip = 1 if pos == 0 else 0
            self.mu[layer] = kv[:, :, skip:].mean(2, keepdim=True)
            self.mu_set[layer] = True
            if old is not None:
                self._write(layer, 0, torch.stack(old))
        self._write(layer, pos, kv)

    def view(self, layer: int, upto: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._stored(layer, upto)
        mu = self.mu[layer]
        return (k @ self.rot + mu[0]).to(dtype), (v @ self.rot + mu[1]).to(dtype)  # (x - mu) R^T R + mu = x

    def attend(self, layer: int, q: torch.Tensor, start_pos: int, attn: Attention) -> torch.Tensor:
        t, h, hd = q.shape
        k, v = self._stored(layer, start_pos + t)
        # scores against k - mu_k differ from q.k by q.mu_k, the same for every key of a query: softmax drops it
        out = attn(q.float() @ self.rot_t, k, v).view(t, h, hd)  # = (o - mu_v) R^T, since sum_j p_j = 1
        mu_v = self.mu[layer, 1, :, 0].repeat_interleave(h // self.n_kv_head, dim=0)  # [H, hd], GQA head map
        return (out @ self.rot + mu_v).reshape(t, h * hd)


_CLASSES = {"q8_0": Q8_0KVCache, "q4_0": Q4_0KVCache, "q4_rot": Q4RotKVCache}


def make_kv_cache(kind: str, n_layer: int, n_kv_head: int, max_seq: int, head_dim: int,
                  device: str | torch.device = "cpu") -> KVCache:
    check_kind(kind, head_dim)
    if kind in KV_DTYPES:
        c = KVCache(n_layer, n_kv_head, max_seq, head_dim, KV_DTYPES[kind], device)
        c.kind = kind
        return c
    return _CLASSES[kind](n_layer, n_kv_head, max_seq, head_dim, device)
