"""The KV cache: one preallocated buffer per model, written at a position and read up to a length.

(The server's slots use ``PagedKVCache``, this interface over a shared pool of blocks: runtime/kv_pool.py.)

Kinds (``make_kv_cache(kind, ...)``, ``pyllm.load(kv_cache=kind)``, ``--kv kind``; ``"K/V"`` such as
``"f16/q8_0"`` picks the key and value types separately, like llama.cpp's -ctk/-ctv; ``--kv-k``/``--kv-v``):

=======  =============  ==================================================================================
kind     bits/value     storage
=======  =============  ==================================================================================
f32      32             plain tensors
f16      16             plain tensors (the default)
bf16     16             plain tensors
q8_0     8.5            llama.cpp's q8_0 blocks: 32 values along head_dim, int8 values + one fp16 scale
q4_0     4.5            llama.cpp's q4_0 blocks: 32 values along head_dim, 4-bit values + one fp16 scale
q4_rot   4.5            q4_0 of each head vector, centered and rotated (randomized Hadamard)
q8_rot   8.5            q8_0 of each head vector, centered and rotated (as q4_rot)
=======  =============  ==================================================================================

Block kinds are stored as llama.cpp lays its blocks out (fp16 scale, then the codes: 34 bytes for q8_0, 18 for
q4_0), one row of head_dim/32 blocks per (layer, head, position), so the C++ decode step reads them as they are.

Every kind has the same interface: ``update(layer, pos, k, v)`` stores (quantizes) new positions, ``view(layer,
upto)`` returns float K/V in the model's basis (dequantized), and ``attend(layer, q, start_pos, attn)`` runs the
model's attention over the cache's own storage -- the rotated kind attends in its rotated basis, so the rotation
costs O(T * head_dim^2) per step instead of O(S * head_dim^2) for un-rotating the whole cache.

Centered keys (every block kind). Keys are stored minus a fixed per-(layer, head) mean mu_k. For one query,
q.(k_j - mu_k) = q.k_j - q.mu_k shifts every score of that query by the same constant, which softmax ignores
(masking keeps only keys of the same query, so it is still one constant per row): attention over centered keys
needs no correction at all. It matters: RoPE leaves the slow channels of K with a large common component --
Qwen2's K bias puts values of 100-200 there -- which otherwise sets the step of every block that holds one. On
Qwen2.5-0.5B a plain q8_0 key cache cost +5.6% perplexity when centering came in; llama.cpp's own q8_0 cache costs
+3.64% (KLD 0.0196) on the same text and GGUF, pyllm's centered one +0.10% (docs/BENCHMARKS.md, "KV cache").

Why the rotation works (q4_rot). Let R = H D / sqrt(n), with H the n x n Sylvester-Hadamard matrix (entries +-1,
n = head_dim, a power of two) and D a fixed diagonal of random signs; R R^T = I. Vectors are rows here, so a head
vector x is stored as x R^T.
  * Scores: (q R^T) . (k R^T) = q R^T R k^T = q . k, so rotating Q the same way leaves softmax(q K^T) unchanged.
  * Values: the output o = sum_j p_j v_j is linear in V, so attending over rotated values gives o R^T, and
    (o R^T) R = o un-rotates it.
  * Offsets: keys are centered as above; values are stored minus a mean mu_v too, and sum_j p_j (v_j - mu_v) =
    o - mu_v because the weights sum to 1, so adding mu_v back to the output is exact.
  * Quantization: each rotated coordinate is a +-1/sqrt(n)-weighted sum of all n coordinates, so a few outlier
    channels (RoPE'd keys and Qwen's K bias have them) are spread over the whole vector. The block absmax then
    tracks the vector's RMS instead of its outliers, and the 4-bit step (absmax / 8) shrinks accordingly. The
    error is committed in the rotated basis; R is orthogonal, so its L2 norm per vector is the same after
    un-rotating. The random signs keep structured vectors (e.g. one aligned with a row of H) from staying peaky.
Balanced key scales (keys of every block kind). A fixed per-(layer, head, channel) scale s is exact for the same
reason: storing k / s and attending with q * s leaves every q . k unchanged. It sets where the rounding error
lands. A score moves by (q * s) . e, e the error of the stored key. Rotated, e is about isotropic with a size set by
the stored vectors' RMS, so the score's error variance goes as sum_c q_c^2 s_c^2 times sum_c k_c^2 / s_c^2
(per-channel mean squares of the centered keys and of the queries); by Cauchy-Schwarz that product is smallest,
(sum_c |q_c| |k_c|)^2, at s_c^2 = rms(k_c) / rms(q_c) -- SmoothQuant's balance (alpha = 1/2) between the two sides
of a product. Unrotated blocks gain the same way: a channel the queries barely read no longer sets its block's
step. Qwen2.5 is the case that needs it: RoPE turns its K bias into a few huge key channels the mean cannot
remove, and its queries hardly use them. Rotation alone spread them over every coordinate (4-bit rotated keys
were worse than plain q4_0 there: +31% perplexity against +17%); with the scales q4_rot is at +2.6% and q8_0
goes from +2.1% to +0.1% (docs/BENCHMARKS.md). The scales come from the same batch as the means, queries included
(``update(..., q=q)``; without queries, from the keys alone: s_c^2 = rms(k_c)).

Exact sink row (every block kind). Position 0 (BOS, or the first token) is where most heads park their
attention -- it holds a large share of every softmax -- so its rounding error reaches every later query with a
large weight. Each block part also keeps position 0's row exactly (float32, in the storage basis, one row per
layer and head: a few KiB); attention reads that row instead of the quantized one. When it came in it halved
SmolLM2's q4_0 KL divergence against f16 (0.095 -> 0.043) and cut Qwen2.5's by a fifth (0.103 -> 0.081); the
current figures are in docs/BENCHMARKS.md, "KV cache".

The means (and scales) are estimated from the first batch written at position 0 (without position 0 itself, often
an attention-sink outlier) and then fixed until the cache is rewritten from position 0.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from .. import ops
from ..errors import PyllmError
from .kv_kinds import BLOCK_BYTES, QK, ROTATED, bytes_per_token, check_kind, join_kind, split_kind

KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}  # the float kinds' tensors

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (q [T,H,hd], k, v [Hkv,S,hd])


def _round_away(x: torch.Tensor) -> torch.Tensor:
    # C's roundf (half away from zero), which llama.cpp uses; torch.round rounds half to even
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp q8_0 of x [..., nb, 32] f32: d = absmax / 127, q = roundf(x / d) in [-127, 127], x ~ q * d.

    Round-trip error per value <= d/2 plus the fp16 rounding of d (relative 2^-11, times |q| <= 127).
    Returns codes int8 [..., nb, 32] and d fp16 [..., nb].
    """
    d = x.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return _round_away(x * inv[..., None]).to(torch.int8), d.to(torch.float16)


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32).mul_(d.to(torch.float32).unsqueeze(-1))


def quantize_q4_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp q4_0 of x [..., nb, 32]: d = m / -8 with m the value of largest magnitude (sign kept),
    q = min(15, floor(x/d + 8.5)), x ~ (q - 8) * d. Codes pack two per byte as llama.cpp does: byte j holds value
    j (low nibble) and j + 16 (high).

    Round-trip error per value <= |d|/2, except values of the sign opposite to m near +|m|, which clamp at q = 15:
    <= |d| = absmax/8 (plus the fp16 rounding of d). Returns packed uint8 [..., nb, 16] and d fp16 [..., nb].
    """
    idx = x.abs().argmax(-1, keepdim=True)  # the first of equal magnitudes, like llama.cpp's strict '<'
    m = x.gather(-1, idx).squeeze(-1)
    d = m / -8.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.floor(x * inv[..., None] + 8.5).clamp_(0, 15).to(torch.uint8)  # [..., nb, 32]
    return q[..., :QK // 2] | (q[..., QK // 2:] << 4), d.to(torch.float16)


def dequantize_q4_0(packed: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
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


class PartLayout(NamedTuple):
    """How one part (keys or values) of a cache is stored, for a fused decode step that reads and writes it.

    A stored row is ``to_storage(x) = ((x - mu) / scale) @ R^T`` of the model-basis row x, encoded as ``block``;
    each of mu, scale, R is absent (None) where the part does not use it. Attention over stored rows takes
    ``(q * scale) @ R^T`` as the query, reads ``sink`` instead of position 0's encoded row, and maps its output o
    back by ``o @ R + mu``. Every tensor is the live one (the cache re-estimates mu and scale in place when it is
    rewritten from position 0), so a step built once stays valid; a step writing position 0 writes ``sink`` too.
    """

    kind: str                    # "f32", "f16", "bf16", "q8_0", "q4_0", "q8_rot", "q4_rot"
    block: str                   # row encoding: "f32", "f16", "bf16", "q8_0", "q4_0" (llama.cpp blocks)
    data: torch.Tensor           # [n_layer, Hkv, max_seq, hd] of the float dtype, or uint8 [..., nb * block bytes]
    mu: torch.Tensor | None      # float32 [n_layer, Hkv, 1, hd]
    scale: torch.Tensor | None   # float32 [n_layer, Hkv, 1, hd] (keys)
    rot: torch.Tensor | None     # float32 [hd, hd]: R
    sink: torch.Tensor | None    # float32 [n_layer, Hkv, 1, hd]: position 0, exact, in the storage basis
    # Paged (runtime/kv_pool.py): data is the pool, [n_blocks, n_layer, Hkv, block_rows, row], and position p of
    # this sequence is row p % block_rows of block table[p // block_rows] (int32, live: filled as it grows).
    table: torch.Tensor | None = None
    block_rows: int = 0


def cache_memory(shape: tuple, dtype: torch.dtype, device, zero: bool = True) -> torch.Tensor:
    """Memory for cache rows: torch.zeros (or, with ``zero`` False, untouched torch.empty), asked onto huge pages
    first where it is on the CPU (ops.advise_huge_pages).  A decode step reads every (layer, head)'s rows, and
    on 4 KiB pages each page costs a TLB miss: SmolLM2 decoded ~10% faster at 2048 cached tokens from huge
    pages, and its 4-sequence step at 340 cached tokens from a block pool took 6.8 ms against 7.3-7.6."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.device.type == "cpu":
        ops.advise_huge_pages(t)
    return t.zero_() if zero else t


class _Rows:
    """Where a part's rows live: here one tensor (n_layer, n_kv_head, max_seq, row) of the cache's own; a paged
    cache's parts read and write the rows of a shared pool of blocks instead (runtime/kv_pool.py)."""

    def __init__(self, data: torch.Tensor):
        self.data = data
        self.buffers = [data]  # what the cache's prefix state holds per position

    def put(self, layer: int, pos: int, x: torch.Tensor) -> None:
        """Rows x [Hkv, T, row] at positions pos..pos+T-1 of ``layer``."""
        self.data[layer, :, pos:pos + x.shape[1]] = x

    def get(self, layer: int, upto: int) -> torch.Tensor:
        """Rows of positions 0..upto-1 of ``layer``: [Hkv, upto, row]."""
        return self.data[layer, :, :upto]

    def put_at(self, layer: int, pos: torch.Tensor, x: torch.Tensor) -> None:
        """Rows x [Hkv, T, row] at the device-held positions pos [T] (int64) of ``layer``: no host sync."""
        self.data[layer].index_copy_(1, pos, x)

    def layout(self, lay: PartLayout) -> PartLayout:
        return lay


class _FloatPart:
    """Keys or values of every layer as a plain tensor (n_layer, n_kv_head, max_seq, head_dim) in ``dtype``."""

    rot = None
    centered = False

    def __init__(self, kind, n_layer, n_kv_head, max_seq, head_dim, device, is_key, rows=None):
        self.kind, self.dtype = kind, KV_DTYPES[kind]
        self.rows = rows or _Rows(cache_memory((n_layer, n_kv_head, max_seq, head_dim), self.dtype, device))
        self.data = self.rows.data
        self.buffers = self.rows.buffers

    def write(self, layer: int, pos: int, x: torch.Tensor) -> None:  # x: [Hkv, T, hd]
        self.rows.put(layer, pos, x.to(self.dtype))

    def write_at(self, layer: int, pos: torch.Tensor, x: torch.Tensor) -> None:  # pos: int64 [T] on the device
        self.rows.put_at(layer, pos, x.to(self.dtype))

    def layout(self) -> PartLayout:
        return self.rows.layout(PartLayout(self.kind, self.kind, self.data, None, None, None, None))

    def stored(self, layer: int, upto: int, sink: bool = True) -> torch.Tensor:
        return self.rows.get(layer, upto)

    def view(self, layer: int, upto: int) -> torch.Tensor:
        return self.rows.get(layer, upto)


class _BlockPart:
    """Keys or values as llama.cpp blocks: uint8 (n_layer, n_kv_head, max_seq, nb * block_bytes), nb = head_dim/32.

    Stored vectors are x - mu (keys of every block kind; values of the rotated kinds), times R^T for those.
    mu: (n_layer, n_kv_head, 1, head_dim) float32 (zeros where not centered).
    """

    def __init__(self, kind, n_layer, n_kv_head, max_seq, head_dim, device, is_key, rows=None):
        self.kind, self.hd, self.hkv = kind, head_dim, n_kv_head
        self.nb, self.bb = head_dim // QK, BLOCK_BYTES[kind]
        self.rows = rows or _Rows(cache_memory((n_layer, n_kv_head, max_seq, self.nb * self.bb), torch.uint8,
                                               device))
        self.data = self.rows.data
        self.q8 = kind in ("q8_0", "q8_rot")
        self.quantize, self.dequantize = (quantize_q8_0, dequantize_q8_0) if self.q8 else (quantize_q4_0,
                                                                                             dequantize_q4_0)
        self.rot = hadamard_rotation(head_dim).to(device) if kind in ROTATED else None  # R [hd, hd]
        self.rot_t = None if self.rot is None else self.rot.T.contiguous()  # R^T: x R^T rotates a row vector x
        self.centered = is_key or self.rot is not None
        self.mu = torch.zeros(n_layer, n_kv_head, 1, head_dim, device=device)
        self.scaled = is_key
        self.scale = torch.ones(n_layer, n_kv_head, 1, head_dim, device=device)  # s: stored keys are k / s
        self.sink = torch.zeros(n_layer, n_kv_head, 1, head_dim, device=device)  # position 0, exact (storage basis)
        self.buffers = (self.rows.buffers + [self.sink] + ([self.mu] if self.centered else [])
                        + ([self.scale] if self.scaled else []))

    def layout(self) -> PartLayout:
        return self.rows.layout(PartLayout(self.kind, "q8_0" if self.q8 else "q4_0", self.data,
                                           self.mu if self.centered else None, self.scale if self.scaled else None,
                                           self.rot, self.sink))

    def to_storage(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Model basis -> storage basis: ((x - mu) / s) [R^T]. x: [Hkv, T, hd] f32. The one definition of the
        transform: attend() and view() invert it, and the fused steps (csrc/cpu/decode_step.cpp) follow it from
        PartLayout (tests/test_decode_step.py ties them for every kind)."""
        if self.centered:
            x = x - self.mu[layer]
        if self.scaled:
            x = x / self.scale[layer]
        return x if self.rot is None else x @ self.rot_t

    def encode(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [Hkv, T, hd] (model basis) -> (its storage-basis rows, their blocks [Hkv, T, nb * bb])."""
        t = x.shape[1]
        y = self.to_storage(layer, x)
        c, d = self.quantize(y.reshape(self.hkv, t, self.nb, QK))
        blk = torch.cat((d.unsqueeze(-1).view(torch.uint8), c.view(torch.uint8)), -1)  # [Hkv, T, nb, bb]
        return y, blk.flatten(-2)

    def write(self, layer: int, pos: int, x: torch.Tensor) -> None:
        y, blk = self.encode(layer, x)
        self.rows.put(layer, pos, blk)
        if pos == 0:
            self.sink[layer] = y[:, :1]

    def write_at(self, layer: int, pos: torch.Tensor, x: torch.Tensor) -> None:
        """write at device-held positions pos [T]: the sink row taken where pos[0] is 0, chosen on the device."""
        y, blk = self.encode(layer, x)
        self.rows.put_at(layer, pos, blk)
        self.sink[layer].copy_(torch.where(pos[0] == 0, y[:, :1], self.sink[layer]))

    def stored(self, layer: int, upto: int, sink: bool = True) -> torch.Tensor:
        """Dequantized, in the storage basis, position 0 exact (its stored row where ``sink`` is False):
        [Hkv, upto, hd] f32."""
        b = self.rows.get(layer, upto).reshape(self.hkv, upto, self.nb, self.bb)
        d = b[..., :2].view(torch.float16)[..., 0]
        c = b[..., 2:].view(torch.int8) if self.q8 else b[..., 2:]
        x = self.dequantize(c, d).view(self.hkv, upto, self.hd)
        if upto and sink:
            x[:, :1] = self.sink[layer]
        return x

    def view(self, layer: int, upto: int) -> torch.Tensor:
        x = self.stored(layer, upto)
        if self.rot is not None:
            x = x @ self.rot  # (x - mu) R^T R = x - mu
        if self.scaled:
            x = x * self.scale[layer]
        return x + self.mu[layer] if self.centered else x


def balanced_key_scale(k: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """s [Hkv, 1, hd] with s_c^2 = rms(k_c) / rms(q_c) (see the module docstring), normalized to RMS 1 per head.

    k: centered keys [Hkv, T, hd]; q: the same positions' queries [T, H, hd] (H a multiple of Hkv), or None (keys
    alone). Channel RMSs are floored at 1/16 of their head's mean so that a channel a short prompt left near zero
    cannot get an extreme scale.
    """
    def rms(x: torch.Tensor, dims) -> torch.Tensor:
        r = x.double().pow(2).mean(dims).sqrt()  # [Hkv, hd]
        return torch.maximum(r, r.mean(-1, keepdim=True) / 16).clamp_min(1e-30)

    s2 = rms(k, 1)
    if q is not None:
        hkv, hd = k.shape[0], k.shape[2]
        s2 = s2 / rms(q.reshape(q.shape[0], hkv, -1, hd), (0, 2))
    s = s2.sqrt()
    return (s / s.pow(2).mean(-1, keepdim=True).sqrt()).float().unsqueeze(1)


def _make_part(kind, *args, is_key, rows=None):
    return (_FloatPart if kind in KV_DTYPES else _BlockPart)(kind, *args, is_key=is_key, rows=rows)


class KVCache:
    """Keys and values of every layer for up to ``max_seq`` positions, each in its own type (``kind`` "K/V").

    ``k_part``/``v_part`` hold the storage. For float kinds ``k``/``v`` are the tensors (n_layer, n_kv_head,
    max_seq, head_dim) themselves. Positions past the valid length hold stale values; the runtime tracks the valid
    length, so truncating the cache (prefix reuse) costs nothing.
    """

    def __init__(self, n_layer: int, n_kv_head: int, max_seq: int, head_dim: int, kind: str = "f16",
                 device: str | torch.device = "cpu"):
        check_kind(kind, head_dim)
        self.n_layer, self.n_kv_head, self.max_seq, self.head_dim = n_layer, n_kv_head, max_seq, head_dim
        self.k_kind, self.v_kind = split_kind(kind)
        self.kind = join_kind(self.k_kind, self.v_kind)
        args = (n_layer, n_kv_head, max_seq, head_dim, device)
        self.k_part = _make_part(self.k_kind, *args, is_key=True, rows=self._part_rows(0))
        self.v_part = _make_part(self.v_kind, *args, is_key=False, rows=self._part_rows(1))
        self.parts = (self.k_part, self.v_part)
        # a plain float cache of one dtype: the tensors and dtype the C++ decode step and older callers read
        same_float = self.k_kind == self.v_kind and self.k_kind in KV_DTYPES
        self.dtype = KV_DTYPES[self.k_kind] if same_float else None
        self.k = self.k_part.data if self.k_kind in KV_DTYPES else None
        self.v = self.v_part.data if self.v_kind in KV_DTYPES else None
        self.mu_set = [False] * n_layer  # False while the layer holds position 0 alone (or nothing)
        self.centered = any(p.centered for p in self.parts)

    def _part_rows(self, index: int):
        """Where part ``index`` (0 keys, 1 values) keeps its rows: None, a tensor of its own."""
        return None

    def trim(self, n: int) -> None:
        """Rows n.. will not be read again: a paged cache gives their blocks back; this one keeps its buffer."""

    @staticmethod
    def bytes_per_token(n_layer: int, n_kv_head: int, head_dim: int, kind: str = "f16") -> float:
        """K and V bytes one position takes in every layer (scales included for the block kinds)."""
        return bytes_per_token(n_layer, n_kv_head, head_dim, kind)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self.parts for t in p.buffers)

    def storage_layout(self) -> tuple[PartLayout, PartLayout]:
        """(keys, values) as stored: what a fused decode step needs to read and extend this cache."""
        return self.k_part.layout(), self.v_part.layout()

    def check_room(self, pos: int, t: int) -> None:
        """PyllmError unless positions pos..pos+t-1 fit in the cache."""
        if pos < 0 or pos + t > self.max_seq:
            raise PyllmError(f"KV cache holds {self.max_seq} positions; cannot write {t} at position {pos}")

    # ---- prefix state: what a prompt cache copies between caches of one layout, or keeps on disk ---------------
    def _buffers(self):
        """(name, tensor, per_position) of every buffer: the rows ([n_layer, Hkv, max_seq, ...]) and the fixed
        statistics (means, key scales, sink rows), which belong to the whole cache."""
        for i, part in enumerate(self.parts):
            for j, b in enumerate(part.buffers):
                yield f"p{i}b{j}", b, b is part.data

    def state_layout(self) -> str:
        """The kind and buffer shapes (the position axis left out): caches with equal layouts exchange state."""
        import json

        shapes = [list(b.shape[:2]) + list(b.shape[3:]) if rows else list(b.shape) for _, b, rows in self._buffers()]
        return json.dumps({"kind": self.kind, "shapes": shapes})

    def prefix_state(self, n: int) -> dict[str, torch.Tensor]:
        """Copies of positions 0..n-1 and of the statistics, by buffer name (for load_prefix_state)."""
        return {name: (b[:, :, :n] if rows else b).contiguous().clone() for name, b, rows in self._buffers()}

    def load_prefix_state(self, state: dict[str, torch.Tensor], n: int) -> None:
        """Positions 0..n-1 and the statistics from ``state`` (prefix_state of a cache of the same layout, with at
        least n rows). Checks every tensor first: ValueError naming the first that does not fit, cache untouched."""
        bufs = list(self._buffers())
        for name, b, rows in bufs:
            src = state.get(name)
            if src is None:
                raise ValueError(f"tensor {name} is missing")
            if rows:
                fits = (src.dim() == b.dim() and src.shape[:2] == b.shape[:2] and src.shape[3:] == b.shape[3:]
                        and src.shape[2] >= n)
                want = f"{list(b.shape[:2]) + ['>=' + str(n)] + list(b.shape[3:])}"
            else:
                fits, want = src.shape == b.shape, f"{list(b.shape)}"
            if not fits or src.dtype != b.dtype:
                raise ValueError(f"tensor {name} has shape {list(src.shape)} {src.dtype}, expected {want} {b.dtype}")
        for name, b, rows in bufs:
            if rows:
                b[:, :, :n].copy_(state[name][:, :, :n])
            else:
                b.copy_(state[name])
        if self.centered:  # the state came from a cache whose statistics were fixed by its first prompt chunk
            self.mu_set = [True] * self.n_layer

    def copy_prefix_from(self, src: "KVCache", n: int) -> None:
        """Positions 0..n-1 and the statistics of ``src`` (same layout) into this cache."""
        if not all(isinstance(p.rows, _Rows) for p in src.parts):  # a paged cache: its rows come gathered
            self.load_prefix_state(src.prefix_state(n), n)
            return
        for (_, d, rows), (_, b, _) in zip(self._buffers(), src._buffers()):
            if rows:
                d[:, :, :n].copy_(b[:, :, :n])
            else:
                d.copy_(b)
        self.mu_set = list(src.mu_set)

    def means_ready(self) -> bool:
        """True once every layer's means are fixed (or the cache has none): the C++ decode step needs it."""
        return not self.centered or all(self.mu_set)

    def update(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None) -> None:
        """Store k, v: (T, n_kv_head, head_dim) at positions pos..pos+T-1 of ``layer``. q: the same positions'
        queries (T, n_head, head_dim), used only to estimate the balanced key scales (block kinds).

        pos may be a device-held int64 [1] tensor (a forward a CUDA graph captures, models/transformer.py): then
        nothing is read back to the host, so the caller has checked the room and the means must be fixed."""
        t = k.shape[0]
        if isinstance(pos, torch.Tensor):
            self._update_at(layer, pos, k, v)
            return
        self.check_room(pos, t)
        k, v = k.transpose(0, 1).float(), v.transpose(0, 1).float()  # [Hkv, T, hd]
        if self.centered:
            kp = self.k_part
            if pos == 0:
                self.mu_set[layer] = False  # the cache is being rewritten from the start: estimate again
                for p in self.parts:
                    if p.centered:
                        p.mu[layer].zero_()
                if getattr(kp, "scaled", False):
                    kp.scale[layer].fill_(1.0)
            if not self.mu_set[layer] and pos + t >= 2:
                old = self.view(layer, pos) if pos else None  # position 0, stored before there was a mean
                skip = 1 if pos == 0 else 0
                for p, x in zip(self.parts, (k, v)):
                    if p.centered:
                        p.mu[layer] = x[:, skip:].mean(1, keepdim=True)
                if getattr(kp, "scaled", False):
                    kp.scale[layer] = balanced_key_scale(k[:, skip:] - kp.mu[layer],
                                                         None if q is None else q[skip:].float())
                self.mu_set[layer] = True
                if old is not None:
                    self.check_room(0, 1)  # a paged cache's block 0 may be shared: it is copied before the write
                    self.k_part.write(layer, 0, old[0])
                    self.v_part.write(layer, 0, old[1])
        self.k_part.write(layer, pos, k)
        self.v_part.write(layer, pos, v)

    def _update_at(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self.means_ready():
            raise PyllmError("a KV cache takes device-held positions only once its means are fixed (its first "
                             "prompt chunk sets them)")
        if not all(isinstance(p.rows, _Rows) for p in self.parts):
            raise PyllmError("a paged KV cache takes host positions only")
        at = pos + torch.arange(k.shape[0], device=pos.device)
        self.k_part.write_at(layer, at, k.transpose(0, 1).float())
        self.v_part.write_at(layer, at, v.transpose(0, 1).float())

    def view(self, layer: int, upto: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions 0..upto-1 as (n_kv_head, upto, head_dim) in ``dtype`` (model basis)."""
        return self.k_part.view(layer, upto).to(dtype), self.v_part.view(layer, upto).to(dtype)

    def attend(self, layer: int, q: torch.Tensor, start_pos: int, attn: Attention) -> torch.Tensor:
        """Attention of q [T, H, hd] (positions start_pos..) over cached positions 0..start_pos+T-1.

        ``attn(q, k, v)`` is the model's attention (mask, scale and window bound in) and returns [T, H*hd]. It runs
        in the storage basis: centered keys need nothing (softmax ignores a per-query shift); scaled and rotated
        keys take (q * s) R^T; rotated/centered values give (o - mu_v) R^T, mapped back here.  A device-held
        start_pos (int64 [1]) hands ``attn`` every row of the cache (its mask leaves out those past the queries).
        """
        t, h, hd = q.shape
        upto = self.max_seq if isinstance(start_pos, torch.Tensor) else start_pos + t
        k = self.k_part.stored(layer, upto).float()
        v = self.v_part.stored(layer, upto).float()
        kp, vp = self.k_part, self.v_part
        g = h // self.n_kv_head
        if getattr(kp, "scaled", False):
            q = q.float() * kp.scale[layer, :, 0].repeat_interleave(g, dim=0)  # [H, hd], GQA head map
        if kp.rot is not None:
            q = q.float() @ kp.rot_t
        out = attn(q, k, v)
        if vp.rot is None and not vp.centered:
            return out
        out = out.view(t, h, hd)
        if vp.rot is not None:
            out = out @ vp.rot
        if vp.centered:
            out = out + vp.mu[layer, :, 0].repeat_interleave(g, dim=0)
        return out.reshape(t, h * hd)


def make_kv_cache(kind: str, n_layer: int, n_kv_head: int, max_seq: int, head_dim: int,
                  device: str | torch.device = "cpu") -> KVCache:
    return KVCache(n_layer, n_kv_head, max_seq, head_dim, kind, device)
