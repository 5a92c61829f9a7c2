"""Quantized weights kept in their GGUF block form, with a torch reference dequantization per block type.

Each dequantizer is vectorized over all blocks at once and does its float32 arithmetic in the same order as
ggml's ``dequantize_row_*`` (and gguf-py's ``gguf.quants``), so the result is bit-for-bit what gguf-py returns.
That makes them the reference for the C++/CUDA kernels. Block layouts: ggml's ggml-common.h.

Nothing here runs at load time: a QTensor is a view of the file until someone asks for values.
"""

from __future__ import annotations

from typing import Callable

import torch

from pyllm.errors import ModelError
from pyllm.formats.gguf import BLOCK_INFO, COMPUTE_TYPES, QK_K, GGMLType, GGUFFile

F32 = torch.float32
# Blocks per dequantization step: bounds the temporaries (a few x the output) when a whole embedding table is
# dequantized, without a Python loop per block.
CHUNK_BLOCKS = 1 << 15

_FLOAT_DTYPES = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}

# IQ4_NL / IQ4_XS non-linear code book (ggml-common.h kvalues_iq4nl).
_IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _shifts(values, shape, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device).reshape(shape)


def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """fp16 at byte ``off`` of every block -> float32 [nb, 1].

    Always a copy: a one-block slice is already contiguous, so .contiguous() would keep the mapping's address, and
    a tensor at an odd file offset (general.alignment 1) cannot be viewed as fp16 there.
    """
    return b[:, off : off + 2].clone(memory_format=torch.contiguous_format).view(torch.float16).to(F32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [nb, 16] -> [nb, 32]: the 16 low nibbles, then the 16 high nibbles (the 32-block element order)."""
    return torch.cat((qs & 15, qs >> 4), dim=1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [nb, 4] holding a little-endian u32 -> its 32 bits as uint8 [nb, 32], bit j at column j."""
    nb = qh.shape[0]
    return ((qh.unsqueeze(-1) >> _shifts(range(8), (1, 1, 8), qh.device)) & 1).reshape(nb, 32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:18]).to(torch.int16) - 8
    return d * q.to(F32)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:20]).to(F32)
    return d * q + m  # two roundings, as in C (no FMA)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = (_nibbles(b[:, 6:22]) | (_bits32(b[:, 2:6]) << 4)).to(torch.int16) - 16
    return d * q.to(F32)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = (_nibbles(b[:, 8:24]) | (_bits32(b[:, 4:8]) << 4)).to(F32)
    return d * q + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return b[:, 2:34].contiguous().view(torch.int8).to(F32) * d


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # scales[16] (lo nibble scale, hi nibble min) | qs[64] | d | dmin
    nb, dev = b.shape[0], b.device
    sc = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (sc & 15).to(F32)).reshape(nb, 16, 1)
    ml = (dmin * (sc >> 4).to(F32)).reshape(nb, 16, 1)
    # each 128-element half uses 32 bytes of qs four times, at shifts 0, 2, 4, 6
    q = (b[:, 16:80].reshape(nb, 2, 1, 32) >> _shifts((0, 2, 4, 6), (1, 1, 4, 1), dev)) & 3
    q = q.reshape(nb, 16, 16).to(F32)
    return (dl * q - ml).reshape(nb, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # hmask[32] | qs[64] | scales[12] (16 x 6-bit) | d
    nb, dev = b.shape[0], b.device
    d = _f16(b, 108)
    lo = (b[:, 96:104].reshape(nb, 1, 8) >> _shifts((0, 4), (1, 2, 1), dev)).reshape(nb, 16)
    hi = (b[:, 104:108].reshape(nb, 1, 4) >> _shifts((0, 2, 4, 6), (1, 4, 1), dev)).reshape(nb, 16)
    scales = ((lo & 15) | ((hi & 3) << 4)).to(torch.int16) - 32
    dl = (d * scales.to(F32)).reshape(nb, 16, 1)
    ql = (b[:, 32:96].reshape(nb, 2, 1, 32) >> _shifts((0, 2, 4, 6), (1, 1, 4, 1), dev)).reshape(nb, 16, 16) & 3
    qh = (b[:, 0:32].reshape(nb, 1, 1, 32) >> _shifts(range(8), (1, 1, 8, 1), dev)).reshape(nb, 16, 16) & 1
    # a clear high bit means "subtract 4"
    q = ql.to(torch.int16) - ((qh ^ 1).to(torch.int16) << 2)
    return (dl * q.to(F32)).reshape(nb, QK_K)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K-quant packed 6-bit scales uint8 [nb, 12] -> (scales, mins) as float32 [nb, 8] (get_scale_min_k4)."""
    nb = s.shape[0]
    s = s.reshape(nb, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc.to(F32), mn.to(F32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # d | dmin | scales[12] | qs[128]; per 64 elements: 32 low nibbles, then 32 high nibbles of the same bytes
    nb, dev = b.shape[0], b.device
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc).reshape(nb, 8, 1)
    ml = (dmin * mn).reshape(nb, 8, 1)
    q = (b[:, 16:144].reshape(nb, 4, 1, 32) >> _shifts((0, 4), (1, 1, 2, 1), dev)) & 15
    return (dl * q.reshape(nb, 8, 32).to(F32) - ml).reshape(nb, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # d | dmin | scales[12] | qh[32] | qs[128]; sub-block j takes its 5th bit from bit j of qh
    nb, dev = b.shape[0], b.device
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc).reshape(nb, 8, 1)
    ml = (dmin * mn).reshape(nb, 8, 1)
    ql = (b[:, 48:176].reshape(nb, 4, 1, 32) >> _shifts((0, 4), (1, 1, 2, 1), dev)).reshape(nb, 8, 32) & 15
    qh = (b[:, 16:48].reshape(nb, 1, 1, 32) >> _shifts(range(8), (1, 1, 8, 1), dev)).reshape(nb, 8, 32) & 1
    q = (ql | (qh << 4)).to(F32)
    return (dl * q - ml).reshape(nb, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # ql[128] | qh[64] | scales int8[16] | d
    nb, dev = b.shape[0], b.device
    d = _f16(b, 208)
    sc = b[:, 192:208].contiguous().view(torch.int8).to(F32)
    dl = (d * sc).reshape(nb, 16, 1)
    ql = (b[:, 0:128].reshape(nb, 2, 1, 64) >> _shifts((0, 4), (1, 1, 2, 1), dev)).reshape(nb, 8, 32) & 15
    qh = (b[:, 128:192].reshape(nb, 2, 1, 32) >> _shifts((0, 2, 4, 6), (1, 1, 4, 1), dev)).reshape(nb, 8, 32) & 3
    q = (ql | (qh << 4)).to(torch.int16) - 32
    return (dl * q.reshape(nb, 16, 16).to(F32)).reshape(nb, QK_K)


def _iq4_table(device) -> torch.Tensor:
    return torch.tensor(_IQ4_VALUES, dtype=F32, device=device)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return d * _iq4_table(b.device)[_nibbles(b[:, 2:18]).long()]


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    # d | scales_h u16 (8 x 2 bits) | scales_l[4] (8 x 4 bits) | qs[128]
    nb, dev = b.shape[0], b.device
    d = _f16(b, 0)
    sh = b[:, 2].to(torch.int32) | (b[:, 3].to(torch.int32) << 8)
    sh = (sh.reshape(nb, 1) >> torch.arange(0, 16, 2, dtype=torch.int32, device=dev)) & 3
    sl = (b[:, 4:8].reshape(nb, 4, 1) >> _shifts((0, 4), (1, 1, 2), dev)).reshape(nb, 8) & 15
    scales = (sl.to(torch.int32) | (sh << 4)) - 32
    dl = (d * scales.to(F32)).reshape(nb, 8, 1)
    q = (b[:, 8:136].reshape(nb, 8, 1, 16) >> _shifts((0, 4), (1, 1, 2, 1), dev)).reshape(nb, 8, 32) & 15
    return (dl * _iq4_table(dev)[q.long()]).reshape(nb, QK_K)


# MXFP4's E2M1 codes as ggml stores their values, doubled (ggml-common.h kvalues_mxfp4): the scale halves them back.
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0_to_fp32_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (uint8) -> float32 2^(e - 128), ggml's GGML_E8M0_TO_FP32_HALF (e < 2: the subnormals)."""
    ei = e.to(torch.int32)
    sub = torch.bitwise_left_shift(torch.full_like(ei, 0x00200000), ei.clamp(max=1))
    return torch.where(ei < 2, sub, (ei - 1) << 23).view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    # e | qs[16]
    d = e8m0_to_fp32_half(b[:, 0:1])
    return d * torch.tensor(MXFP4_VALUES, dtype=F32, device=b.device)[_nibbles(b[:, 1:17]).long()]


def _float_blocks(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def f(b: torch.Tensor) -> torch.Tensor:
        return b.contiguous().view(dtype).to(F32)

    return f


# ggml type -> function(uint8 [nb, type_size]) -> float32 [nb, block_size]
DEQUANTIZERS: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.F32: _float_blocks(torch.float32),
    GGMLType.F16: _float_blocks(torch.float16),
    GGMLType.BF16: _float_blocks(torch.bfloat16),
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q2_K: _q2_k,
    GGMLType.Q3_K: _q3_k,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
    GGMLType.IQ4_NL: _iq4_nl,
    GGMLType.IQ4_XS: _iq4_xs,
    GGMLType.MXFP4: _mxfp4,
}
assert set(DEQUANTIZERS) == COMPUTE_TYPES, "gguf.COMPUTE_TYPES must list exactly the types dequantized here"


def _unsupported(qtype: int, what: str) -> ModelError:
    name = GGMLType(qtype).name if qtype in GGMLType._value2member_map_ else f"unknown type id {qtype}"
    return ModelError(
        f"{what} has type {name}, which pyllm cannot compute with; supported: "
        f"{', '.join(t.name for t in sorted(COMPUTE_TYPES))}"
    )


def dequantize_blocks(qtype: GGMLType, blocks: torch.Tensor, dtype: torch.dtype = F32) -> torch.Tensor:
    """Raw blocks uint8 [..., n * type_size] -> values ``dtype`` [n_blocks * block_size] (flat, element order).

    Works in chunks of CHUNK_BLOCKS blocks so the temporaries stay small next to the output.
    """
    fn = DEQUANTIZERS.get(qtype)
    if fn is None:
        raise _unsupported(qtype, "tensor")
    bs, ts = BLOCK_INFO[qtype]
    b = blocks.reshape(-1, ts)
    nb = b.shape[0]
    if nb <= CHUNK_BLOCKS:
        return fn(b).to(dtype).reshape(-1)
    out = torch.empty((nb, bs), dtype=dtype, device=b.device)
    for i in range(0, nb, CHUNK_BLOCKS):
        out[i : i + CHUNK_BLOCKS] = fn(b[i : i + CHUNK_BLOCKS])
    return out.reshape(-1)


class QTensor:
    """One weight in its file form: raw GGUF blocks plus a reference dequantizer.

    ``qtype``: GGMLType; ``shape``: torch order, ``(N, K)`` for a matrix, ``(K,)`` for a vector; ``data``: uint8
    ``(N, row_bytes)`` (``(*shape[:-1], row_bytes)`` in general), usually a zero-copy view of the mapped file.
    Float types (F32/F16/BF16) keep uint8 ``data`` too (kernels check one dtype); ``typed()`` is their zero-copy
    view in their own dtype.
    """

    __slots__ = ("qtype", "shape", "data", "name")

    def __init__(self, qtype: GGMLType, shape: tuple[int, ...], data: torch.Tensor, name: str = "tensor"):
        if qtype not in DEQUANTIZERS:
            raise _unsupported(qtype, repr(name))
        self.qtype = GGMLType(qtype)
        self.shape = tuple(int(s) for s in shape)
        self.name = name
        bs, ts = BLOCK_INFO[self.qtype]
        if not self.shape or self.shape[-1] % bs:
            raise ModelError(f"{name!r}: shape {self.shape} does not hold whole {self.qtype.name} blocks of {bs}")
        if data.dtype != torch.uint8:
            raise ModelError(f"{name!r}: data must be uint8 raw blocks, got {data.dtype}")
        row_bytes = self.shape[-1] // bs * ts
        want = (*self.shape[:-1], row_bytes)
        n = 1
        for s in want:
            n *= s
        if data.numel() != n:
            raise ModelError(
                f"{name!r}: {data.numel()} bytes of data for {self.qtype.name} shape {self.shape}, need {n}"
            )
        self.data = data.reshape(want)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def block_size(self) -> int:
        return BLOCK_INFO[self.qtype][0]

    @property
    def type_size(self) -> int:
        return BLOCK_INFO[self.qtype][1]

    @property
    def is_float(self) -> bool:
        return self.qtype in _FLOAT_DTYPES

    @property
    def device(self) -> torch.device:
        return self.data.device

    def typed(self) -> torch.Tensor:
        """Zero-copy view of a float tensor's data in its own dtype (f32/f16/bf16), shape ``self.shape``.

        It aliases the mapped file (privately: writes never reach the file, but are seen by later reads).
        """
        if self.qtype not in _FLOAT_DTYPES:
            raise ModelError(f"{self.name!r}: typed() is for float tensors, this one is {self.qtype.name}")
        dt = _FLOAT_DTYPES[self.qtype]
        data = self.data
        if data.data_ptr() % dt.itemsize:
            # a file with alignment 1 or 2 may place a float tensor at an odd offset: a view is impossible there
            data = data.clone()
        return data.view(dt).reshape(self.shape)

    def dequantize(self, dtype: torch.dtype = F32) -> torch.Tensor:
        """All values as a new ``dtype`` tensor of ``self.shape`` (``[N, K]`` for a matrix)."""
        if self.qtype in _FLOAT_DTYPES:
            # .to() would return the file view itself when the dtype already matches; callers own the result
            return self.typed().to(dtype, copy=True)
        return dequantize_blocks(self.qtype, self.data, dtype).reshape(self.shape)

    def rows(self, idx: torch.Tensor, dtype: torch.dtype = F32) -> torch.Tensor:
        """Dequantize only rows ``idx`` (int tensor of any shape) -> ``dtype`` ``[*idx.shape, K]``.

        The embedding lookup: ``token_embd.rows(tokens)`` touches len(tokens) rows, not the table.
        """
        if len(self.shape) != 2:
            raise ModelError(f"{self.name!r}: rows() needs a matrix, shape is {self.shape}")
        idx = torch.as_tensor(idx)
        if idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise ModelError(f"{self.name!r}: row indices must be integers, got {idx.dtype}")
        flat = idx.reshape(-1).to(device=self.data.device, dtype=torch.long)
        n = self.shape[0]
        if flat.numel():
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= n:
                bad = lo if lo < 0 else hi
                raise ModelError(f"{self.name!r}: row index {bad} is out of range for {n} rows")
        sel = self.data.index_select(0, flat)
        if self.qtype in _FLOAT_DTYPES:
            vals = sel.view(_FLOAT_DTYPES[self.qtype]).to(dtype)
        else:
            vals = dequantize_blocks(self.qtype, sel, dtype)
        return vals.reshape(*idx.shape, self.shape[1])

    def to(self, device: torch.device | str) -> QTensor:
        """The same weight with its raw blocks on ``device`` (a copy unless already there)."""
        return QTensor(self.qtype, self.shape, self.data.to(device), self.name)

    def __repr__(self) -> str:
        return f"QTensor({self.name!r}, {self.qtype.name}, shape={self.shape}, {self.nbytes} bytes, {self.device})"


def qtensor_from_gguf(gf: GGUFFile, name: str) -> QTensor:
    """The tensor ``name`` of an open file as a QTensor over a zero-copy view of its blocks.

    Raises ModelError naming the tensor when its type has no dequantizer (GGUFError when there is no such tensor).
    """
    info = gf.info(name)
    if info.ggml_type not in DEQUANTIZERS:
        raise _unsupported(info.ggml_type, f"{gf.path}: tensor {name!r}")
    return QTensor(info.ggml_type, info.shape, gf.raw(name), name)
