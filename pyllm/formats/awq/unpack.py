"""AWQTensor: one linear's int4 weight as an AutoAWQ "gemm" checkpoint packs it (pyllm/formats/awq/__init__.py describes
the packing), unpacked to its codes and dequantized, whole or a few rows, chunk by chunk."""

from __future__ import annotations

import torch

from ...errors import AWQError, ModelError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


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
