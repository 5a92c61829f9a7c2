"""GGUF reader: a validated header, the metadata as Python values, and zero-copy uint8 views of the tensor data.

The file is memory-mapped, never read whole. Every count and length in the header is checked against the bytes
left in the file before anything is allocated, so a corrupt or hostile file fails with a ``GGUFError`` that names
the file, the field or tensor, the bad value and (where it helps) the byte offset, instead of a MemoryError, an
IndexError or a segfault later. The layout follows ggml's ``docs/gguf.md``.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pyllm.errors import GGUFError
from pyllm.safe_io import open_regular

if TYPE_CHECKING:
    import torch

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
# Far above any real tensor (a 1T-parameter model has ~2**40 weights in total), far below where sizes get silly.
MAX_ELEMENTS = 2**40
# Nested arrays are legal, but nothing real nests more than once; the cap keeps a crafted file from recursing deep.
MAX_ARRAY_DEPTH = 8


class GGMLType(IntEnum):
    """ggml tensor type ids as stored in GGUF tensor infos (ggml.h ``enum ggml_type``)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


QK_K = 256

# (elements per block, bytes per block), from ggml's type traits (sizeof(block_*)). Q8_1 is 36 bytes in ggml
# (two fp16 + 32 int8); gguf-py says 40, but Q8_1 is an activation format that never appears in model files.
BLOCK_INFO: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q8_1: (32, 36),
    GGMLType.Q2_K: (QK_K, 84),
    GGMLType.Q3_K: (QK_K, 110),
    GGMLType.Q4_K: (QK_K, 144),
    GGMLType.Q5_K: (QK_K, 176),
    GGMLType.Q6_K: (QK_K, 210),
    GGMLType.Q8_K: (QK_K, 292),
    GGMLType.IQ2_XXS: (QK_K, 66),
    GGMLType.IQ2_XS: (QK_K, 74),
    GGMLType.IQ3_XXS: (QK_K, 98),
    GGMLType.IQ1_S: (QK_K, 50),
    GGMLType.IQ4_NL: (32, 18),
    GGMLType.IQ3_S: (QK_K, 110),
    GGMLType.IQ2_S: (QK_K, 82),
    GGMLType.IQ4_XS: (QK_K, 136),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (QK_K, 56),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (QK_K, 54),
    GGMLType.TQ2_0: (QK_K, 66),
    GGMLType.MXFP4: (32, 17),
}

# Types pyllm can compute with: exactly those with a reference dequantizer in pyllm.formats.quant (a test keeps the two
# in step). Lives here, not in quant.py, so that loaders can check a file before building any QTensor.
COMPUTE_TYPES: frozenset[GGMLType] = frozenset(
    {
        GGMLType.F32, GGMLType.F16, GGMLType.BF16,
        GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
        GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
        GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.MXFP4,
    }
)  # fmt: skip


def is_compute_type(t: int) -> bool:
    """True when pyllm has a dequantizer (and so can run a matmul) for ggml type id ``t``."""
    return t in COMPUTE_TYPES


class ValueType(IntEnum):
    """GGUF metadata value types (gguf.h ``enum gguf_type``)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# Fixed-size scalar types: struct format and numpy dtype (little-endian).
_SCALAR = {
    ValueType.UINT8: ("<B", "<u1"),
    ValueType.INT8: ("<b", "<i1"),
    ValueType.UINT16: ("<H", "<u2"),
    ValueType.INT16: ("<h", "<i2"),
    ValueType.UINT32: ("<I", "<u4"),
    ValueType.INT32: ("<i", "<i4"),
    ValueType.FLOAT32: ("<f", "<f4"),
    ValueType.BOOL: ("<B", "<u1"),
    ValueType.UINT64: ("<Q", "<u8"),
    ValueType.INT64: ("<q", "<i8"),
    ValueType.FLOAT64: ("<d", "<f8"),
}
_SCALAR_STRUCT = {t: struct.Struct(f) for t, (f, _) in _SCALAR.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_INT_TYPES = frozenset(
    {ValueType.UINT8, ValueType.INT8, ValueType.UINT16, ValueType.INT16, ValueType.UINT32, ValueType.INT32,
     ValueType.UINT64, ValueType.INT64}
)  # fmt: skip


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in the header, already validated against the file.

    ``shape`` is in torch order (ggml's ``ne`` reversed): a linear weight is ``(N, K)``; ``offset`` is absolute
    in the file; ``nbytes`` is the size of its data.
    """

    name: str
    ggml_type: GGMLType
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of ``shape[-1]`` values (whole blocks)."""
        bs, ts = BLOCK_INFO[self.ggml_type]
        return self.shape[-1] // bs * ts


def _type_name(t: int) -> str:
    try:
        return ValueType(t).name
    except ValueError:
        return f"unknown type {t}"


class _Parser:
    """Bounds-checked cursor over the mapped header. Every read checks the bytes left before touching memory."""

    def __init__(self, path: str, mm: mmap.mmap, size: int):
        self.path = path
        self.mm = mm
        self.size = size
        self.pos = 0

    def fail(self, msg: str, at: int | None = None) -> GGUFError:
        where = f" at byte {at}" if at is not None else ""
        return GGUFError(f"{self.path}: {msg}{where}")

    def need(self, n: int, what: str) -> None:
        left = self.size - self.pos
        if n > left:
            raise self.fail(
                f"truncated file: {what} needs {n} bytes at byte {self.pos}, but only {left} are left "
                f"(file is {self.size} bytes)"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.mm, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.mm, self.pos)
        self.pos += 8
        return v

    def raw_string(self, what: str) -> bytes:
        start = self.pos
        n = self.u64(f"length of {what}")
        if n > self.size - self.pos:
            raise self.fail(
                f"{what} at byte {start} claims length {n}, but only {self.size - self.pos} bytes are left; "
                "the file is truncated or corrupt"
            )
        b = self.mm[self.pos : self.pos + n]
        self.pos += n
        return b

    def name(self, what: str) -> str:
        start = self.pos
        b = self.raw_string(what)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8: {b[:40]!r}", start) from None

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        if vtype in _SCALAR_STRUCT:
            st = _SCALAR_STRUCT[vtype]
            self.need(st.size, f"value of {key!r}")
            (v,) = st.unpack_from(self.mm, self.pos)
            self.pos += st.size
            return bool(v) if vtype == ValueType.BOOL else v
        if vtype == ValueType.STRING:
            # Token strings need not be valid UTF-8 (byte-fallback vocabularies); surrogateescape keeps the exact
            # bytes recoverable with s.encode("utf-8", "surrogateescape").
            return self.raw_string(f"string value of {key!r}").decode("utf-8", "surrogateescape")
        if vtype == ValueType.ARRAY:
            return self.array(key, depth)
        raise self.fail(f"metadata {key!r} has unknown value type {vtype}", self.pos - 4)

    def array(self, key: str, depth: int) -> list:
        start = self.pos
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"metadata {key!r}: arrays nested more than {MAX_ARRAY_DEPTH} deep", start)
        etype = self.u32(f"array element type of {key!r}")
        count = self.u64(f"array length of {key!r}")
        if etype in _SCALAR:
            min_size = _SCALAR_STRUCT[etype].size
        elif etype == ValueType.STRING:
            min_size = 8  # the u64 length, even for an empty string
        elif etype == ValueType.ARRAY:
            min_size = 12  # u32 type + u64 count
        else:
            raise self.fail(f"metadata {key!r}: array has unknown element type {etype}", start)
        left = self.size - self.pos
        if count * min_size > left:
            raise self.fail(
                f"metadata {key!r}: array of {count} {_type_name(etype)} needs at least {count * min_size} bytes, "
                f"but only {left} are left; the file is truncated or corrupt",
                start,
            )
        if etype in _SCALAR:
            n = count * min_size
            a = np.frombuffer(self.mm[self.pos : self.pos + n], dtype=_SCALAR[etype][1])
            self.pos += n
            return (a != 0).tolist() if etype == ValueType.BOOL else a.tolist()
        if etype == ValueType.STRING:
            return self.string_array(key, count)
        return [self.array(key, depth + 1) for _ in range(count)]

    def string_array(self, key: str, count: int) -> list[str]:
        # The hot loop of the header (vocabularies hold 150k-260k strings): locals only, one bounds check each.
        mm, pos, size = self.mm, self.pos, self.size
        unpack = _U64.unpack_from
        out: list[str] = [""] * count
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"length of string #{i} of {key!r}")
            (n,) = unpack(mm, pos)
            pos += 8
            end = pos + n
            if end > size:
                raise self.fail(
                    f"metadata {key!r}: string #{i} claims length {n}, but only {size - pos} bytes are left; "
                    "the file is truncated or corrupt",
                    pos - 8,
                )
            out[i] = mm[pos:end].decode("utf-8", "surrogateescape")
            pos = end
        self.pos = pos
        return out


class GGUFFile:
    """An open, validated GGUF file.

    Attributes: ``path`` (Path), ``version`` (2 or 3), ``metadata`` (dict key -> Python value; arrays are lists),
    ``tensors`` (dict name -> TensorInfo, in file order), ``alignment`` (int), ``data_offset`` (absolute start of
    the data section). Tensor data stays in the mapping: ``raw(name)`` is a view, not a copy.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        shown = str(path)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise GGUFError(f"{shown}: no such file") from None
        except OSError as e:
            raise GGUFError(f"{shown}: cannot open: {e.strerror}") from None
        if os.path.isdir(path):
            raise GGUFError(f"{shown}: is a directory, not a GGUF file")
        size = st.st_size
        if size < 4:
            raise GGUFError(f"{shown}: not a GGUF file: only {size} bytes (a GGUF file starts with b'GGUF')")
        try:
            with open_regular(path, GGUFError) as f:  # a FIFO or device put there since the stat: refused
                # ACCESS_COPY: a private mapping, so torch views are writable (torch warns on read-only buffers)
                # and a stray in-place op can never write into the user's model file.
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                # kept open to fstat the very file that is mapped (the path may since name another file)
                self._fd: int | None = os.dup(f.fileno())
                st = os.fstat(self._fd)
        except OSError as e:
            raise GGUFError(f"{shown}: cannot map the file: {e.strerror or e}") from None
        self._stamp = (st.st_size, st.st_mtime_ns)
        self._mm: mmap.mmap | None = mm
        try:
            self._parse(shown, mm, size)
        except BaseException:
            mm.close()
            self._mm = None
            self._close_fd()
            raise
        # One view of the whole mapping; tensors are slices of it. Going through numpy matters: the ndarray holds
        # a buffer export on the mmap, so the mapping cannot be unmapped while any tensor still points into it
        # (torch.frombuffer holds no export, and closing the mmap under it would segfault).
        # The torch view of it is made at the first raw(): reading the header alone (`pyllm pull`, `info`) then
        # never imports torch (~2 s).
        self._bytes: np.ndarray | None = np.frombuffer(mm, dtype=np.uint8)
        self._u8: torch.Tensor | None = None

    def _parse(self, shown: str, mm: mmap.mmap, size: int) -> None:
        magic = mm[:4]
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{shown}: not a GGUF file: it starts with {magic!r}, expected {GGUF_MAGIC!r}")
        p = _Parser(shown, mm, size)
        p.pos = 4
        version = p.u32("version")
        if version not in SUPPORTED_VERSIONS:
            hint = ""
            if version & 0xFFFF == 0 and version >> 16:
                hint = " (this looks like a big-endian GGUF, which pyllm does not read)"
            elif version == 1:
                hint = " (GGUF v1 is obsolete; re-convert the model)"
            raise GGUFError(
                f"{shown}: unsupported GGUF version {version}{hint}; "
                f"supported: {', '.join(map(str, SUPPORTED_VERSIONS))}"
            )
        self.version = version
        n_tensors = p.u64("tensor count")
        n_kv = p.u64("metadata count")
        # Cheapest possible entries: a KV is u64 key length + u32 type + a 1-byte value, a tensor info is u64 name
        # length + u32 n_dims + one u64 dim + u32 type + u64 offset. Counts that cannot fit are rejected up front.
        left = size - p.pos
        if n_kv * 13 > left:
            raise p.fail(
                f"metadata count {n_kv} cannot fit in the {left} bytes left; the file is truncated or corrupt", 16
            )
        if n_tensors * 32 > left:
            raise p.fail(
                f"tensor count {n_tensors} cannot fit in the {left} bytes left; the file is truncated or corrupt", 8
            )

        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            at = p.pos
            key = p.name(f"key of metadata #{i}")
            if key in metadata:
                raise p.fail(f"duplicate metadata key {key!r}", at)
            vtype = p.u32(f"value type of {key!r}")
            if vtype not in ValueType._value2member_map_:
                raise p.fail(f"metadata {key!r} has unknown value type {vtype}", p.pos - 4)
            metadata[key] = p.value(vtype, key)
        self.metadata = metadata

        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        valid = isinstance(alignment, int) and not isinstance(alignment, bool) and alignment > 0
        if not valid or alignment & (alignment - 1):
            raise p.fail(f"general.alignment is {alignment!r}; it must be a positive power of two")
        self.alignment = alignment

        infos: list[tuple[str, int, tuple[int, ...], int, int]] = []  # name, type, ne, rel offset, header pos
        names: set[str] = set()
        for i in range(n_tensors):
            at = p.pos
            name = p.name(f"name of tensor #{i}")
            if name in names:
                raise p.fail(f"duplicate tensor name {name!r}", at)
            names.add(name)
            n_dims = p.u32(f"n_dims of tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise p.fail(f"tensor {name!r} has n_dims {n_dims}; must be 1..{MAX_DIMS}", p.pos - 4)
            ne = []
            n_el = 1
            for d in range(n_dims):
                dim = p.u64(f"dimension {d} of tensor {name!r}")
                if dim < 1:
                    raise p.fail(f"tensor {name!r} has dimension {d} = {dim}; dimensions must be >= 1", p.pos - 8)
                n_el *= dim
                if n_el > MAX_ELEMENTS:
                    raise p.fail(
                        f"tensor {name!r} has dimensions {ne + [dim]} whose product exceeds {MAX_ELEMENTS} elements",
                        at,
                    )
                ne.append(dim)
            type_id = p.u32(f"type of tensor {name!r}")
            if type_id not in GGMLType._value2member_map_:
                raise p.fail(f"tensor {name!r} has unknown ggml type id {type_id}", p.pos - 4)
            rel = p.u64(f"offset of tensor {name!r}")
            infos.append((name, type_id, tuple(ne), rel, at))

        self.data_offset = (p.pos + alignment - 1) // alignment * alignment
        if infos and self.data_offset > size:
            raise p.fail(
                f"truncated file: the data section would start at byte {self.data_offset}, past the end of the file "
                f"({size} bytes)"
            )

        tensors: dict[str, TensorInfo] = {}
        for name, type_id, ne, rel, at in infos:
            gt = GGMLType(type_id)
            if gt not in BLOCK_INFO:
                raise p.fail(f"tensor {name!r} has ggml type {gt.name} ({type_id}), whose block size is unknown", at)
            bs, ts = BLOCK_INFO[gt]
            if ne[0] % bs:
                raise p.fail(
                    f"tensor {name!r} ({gt.name}): first dimension {ne[0]} is not a multiple of the block size {bs}", at
                )
            nbytes = ne[0] // bs * ts
            for d in ne[1:]:
                nbytes *= d
            if rel % alignment:
                raise p.fail(f"tensor {name!r}: data offset {rel} is not a multiple of the alignment {alignment}", at)
            start = self.data_offset + rel
            end = start + nbytes
            if end > size:
                raise p.fail(
                    f"tensor {name!r}: data range {start}..{end} extends past the end of the file ({size} bytes); "
                    "the file is truncated",
                    at,
                )
            tensors[name] = TensorInfo(name, gt, tuple(reversed(ne)), start, nbytes)

        by_start = sorted(tensors.values(), key=lambda t: t.offset)
        for a, b in zip(by_start, by_start[1:]):
            if b.offset < a.offset + a.nbytes:
                raise p.fail(
                    f"tensor {b.name!r} (data {b.offset}..{b.offset + b.nbytes}) overlaps tensor {a.name!r} "
                    f"(data {a.offset}..{a.offset + a.nbytes})"
                )
        self.tensors = tensors

    # -- access -------------------------------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value for ``key`` (Python int/float/bool/str, or a list for arrays), else ``default``."""
        return self.metadata.get(key, default)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: no tensor named {name!r}") from None

    def raw(self, name: str) -> torch.Tensor:
        """Zero-copy uint8 view of a tensor's data in the mapping.

        Shape ``(N, row_bytes)`` for a 2-D tensor of torch shape ``(N, K)``, ``(nbytes,)`` otherwise. The view
        keeps the mapping alive on its own, so it stays valid after ``close()``.
        """
        t = self.info(name)
        if self._bytes is None:
            raise GGUFError(f"{self.path}: file is closed")
        if self._u8 is None:
            import torch

            self._u8 = torch.from_numpy(self._bytes)
        v = self._u8[t.offset : t.offset + t.nbytes]
        if len(t.shape) == 2:
            v = v.view(t.shape[0], t.row_bytes)
        return v

    def unsupported_tensors(self) -> dict[str, GGMLType]:
        """Tensors whose type pyllm cannot compute with (no dequantizer), name -> type; empty when all are fine."""
        return {n: t.ggml_type for n, t in self.tensors.items() if t.ggml_type not in COMPUTE_TYPES}

    def check_supported(self, names=None) -> None:
        """Raise GGUFError listing the tensors (all, or ``names``) whose type pyllm cannot compute with."""
        bad = self.unsupported_tensors()
        if names is not None:
            bad = {n: bad[n] for n in names if n in bad}
        if bad:
            types = sorted({t.name for t in bad.values()})
            first = ", ".join(f"{n!r} ({t.name})" for n, t in list(bad.items())[:3])
            raise GGUFError(
                f"{self.path}: {len(bad)} tensor(s) use types pyllm cannot compute with ({', '.join(types)}), "
                f"e.g. {first}; supported: {', '.join(sorted(t.name for t in COMPUTE_TYPES))}"
            )

    def check_unchanged(self) -> None:
        """GGUFError if the mapped file was truncated or rewritten since it was opened.

        Why: the weights are read from the mapping, not copied; pages of a file truncated under it raise SIGBUS on
        the next read (the process dies), and pages rewritten in place silently change the weights. One fstat
        (about a microsecond) before each forward pass turns both into an error. A change landing *during* a
        forward pass is not caught (see docs/SECURITY.md)."""
        if self._fd is None:
            return
        try:
            st = os.fstat(self._fd)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot check the model file: {e.strerror or e}") from None
        size, mtime = self._stamp
        if st.st_size != size:
            raise GGUFError(f"{self.path}: the model file changed size while loaded ({size} -> {st.st_size} bytes); "
                            f"load it again")
        if st.st_mtime_ns != mtime:
            raise GGUFError(f"{self.path}: the model file was modified while loaded; load it again")

    def _close_fd(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        """Drop this object's hold on the mapping. Views already handed out keep it mapped until they are freed."""
        self._close_fd()
        self._bytes = self._u8 = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # tensors still point into it; the mapping goes away with the last of them

    def __del__(self):
        try:
            self._close_fd()
        except Exception:  # at interpreter exit the os module may already be gone
            pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, {len(self.tensors)} tensors)"


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and validate a GGUF file. Raises GGUFError naming the file, the field or tensor and the bad value."""
    return GGUFFile(path)


class NeedMoreBytes(Exception):
    """expected_file_size: the header goes on past the bytes given."""


def expected_file_size(head: bytes, shown: str = "download") -> int:
    """The size a GGUF file starting with ``head`` has: the end of its last tensor's data, from the header and
    tensor table alone (what a download with no announced length is capped at). NeedMoreBytes while ``head`` ends
    inside the header; GGUFError when it is not a GGUF header."""
    pos = 0

    def take(n: int) -> memoryview:
        nonlocal pos
        if pos + n > len(head):
            raise NeedMoreBytes
        pos += n
        return memoryview(head)[pos - n:pos]

    def u32() -> int:
        return _U32.unpack(take(4))[0]

    def u64() -> int:
        return _U64.unpack(take(8))[0]

    def skip_value(vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALAR_STRUCT:
            return _SCALAR_STRUCT[vtype].unpack(take(_SCALAR_STRUCT[vtype].size))[0]
        if vtype == ValueType.STRING:
            take(u64())
            return None
        if vtype == ValueType.ARRAY and depth < MAX_ARRAY_DEPTH:
            etype, count = u32(), u64()
            if etype in _SCALAR_STRUCT:
                take(count * _SCALAR_STRUCT[etype].size)
            else:
                for _ in range(count):
                    skip_value(etype, depth + 1)
            return None
        raise GGUFError(f"{shown}: not a usable GGUF header: value type {vtype} at byte {pos - 4}")

    if bytes(head[:4]) != GGUF_MAGIC[:len(head[:4])]:
        raise GGUFError(f"{shown}: not a GGUF file: it starts with {bytes(head[:4])!r}, expected {GGUF_MAGIC!r}")
    take(4)
    if u32() not in SUPPORTED_VERSIONS:
        raise GGUFError(f"{shown}: not a usable GGUF header: unsupported version")
    n_tensors, n_kv = u64(), u64()
    if n_tensors > 1 << 24 or n_kv > 1 << 24:
        raise GGUFError(f"{shown}: not a usable GGUF header: {n_tensors} tensors, {n_kv} metadata entries")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = bytes(take(u64()))
        vtype = u32()
        v = skip_value(vtype)
        if key == b"general.alignment" and isinstance(v, int) and v > 0:
            alignment = v
    end = 0
    for _ in range(n_tensors):
        take(u64())
        n_dims = u32()
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{shown}: not a usable GGUF header: a tensor with {n_dims} dimensions")
        ne = [u64() for _ in range(n_dims)]
        type_id, rel = u32(), u64()
        info = BLOCK_INFO.get(GGMLType(type_id)) if type_id in GGMLType._value2member_map_ else None
        if info is None or ne[0] % info[0] or math.prod(ne) > MAX_ELEMENTS:
            raise GGUFError(f"{shown}: not a usable GGUF header: tensor type {type_id}, dimensions {ne}")
        end = max(end, rel + math.prod(ne) // info[0] * info[1])
    data_offset = (pos + alignment - 1) // alignment * alignment
    return data_offset + end if n_tensors else pos
