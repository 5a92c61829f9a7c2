"""The safetensors shards of a folder, each memory-mapped privately (a header parse + zero-copy views, like
gguf.py): every header entry is checked before it is used as a size or an offset, and nothing is read until a
tensor is."""

from __future__ import annotations

import math
import mmap
import os
import struct
from pathlib import Path

import numpy as np
import torch

from ...errors import AWQError
from ...safe_io import open_regular, parse_json
from .config import read_folder_json, short


def _uint_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


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
            header = parse_json(bytes(mm[8:8 + hlen]))
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
                raise AWQError(f"{shown}: tensor {name!r} has a malformed header entry (dtype {short(dt)}, shape "
                               f"{short(shape)}, data_offsets {short(offsets)})")
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


def open_shards(root: Path) -> dict[str, SafetensorsFile]:
    """tensor name -> its open shard (model.safetensors.index.json if present, else every *.safetensors)."""
    index = root / "model.safetensors.index.json"
    files: dict[str, SafetensorsFile] = {}
    where: dict[str, SafetensorsFile] = {}
    if index.exists():
        wm = read_folder_json(index).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise AWQError(f"{index}: has no weight_map")
        odd = next((v for v in wm.values() if not isinstance(v, str)), None)
        if odd is not None:
            raise AWQError(f"{index}: weight_map names a shard {short(odd)}, which is not a file name")
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
