"""AWQRows: an AWQ int4 weight repacked once at load into the extension's CPU row layout, which the GEMV, prefill
and dequantize kernels read like GGUF blocks; repack / repack_weights do it where a layout exists."""

from __future__ import annotations

import torch

from ...errors import PyllmError
from .unpack import AWQTensor


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
        from ... import _ext

        return _ext.load().dequantize(self.data, self.qtype).to(dtype)

    def rows(self, idx: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from ... import _ext

        idx = torch.as_tensor(idx)
        return _ext.load().dequantize(self.data, self.qtype, idx.reshape(-1)).to(dtype).reshape(*idx.shape, -1)

    def __repr__(self) -> str:
        return f"AWQRows({self.name!r}, qtype {self.qtype}, shape={self.shape}, group_size={self.group_size})"


def repack(w: AWQTensor, C=None) -> AWQRows | None:
    """``w`` in the CPU row layout (the C++ repacker), or None where it has none: a group size other than
    32/64/128/256, scales that fp16 cannot hold exactly (the layout stores fp16), or a non-CPU tensor."""
    if C is None:
        from ... import _ext

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
    from ... import _ext

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
