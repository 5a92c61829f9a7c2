#!/usr/bin/env python3
"""Mutation fuzzer for pyllm's GGUF reader (and, with --deep, the loaders that read its metadata).

Every case is a byte string derived deterministically from (seed, case index): a real fixture header or a small
synthetic file, mutated by bit flips, byte writes, targeted writes to header fields (counts, string and array
lengths, value/element/tensor types, n_dims, dimensions, offsets) with "interesting" values, truncations, inserted,
deleted and duplicated ranges, or a tensor table generated at random from scratch. Each case is written to a file
and opened through ``pyllm.formats.gguf.open_gguf``; for files that open, every tensor is read through ``raw()`` (first
and last byte, the whole view when small) and the reader's promises are re-checked (data inside the file, aligned,
sizes consistent with type and shape, no overlaps).

A case fails when anything other than a ``PyllmError`` escapes, a promise is broken, the worker process dies
(segfault, bus error, abort), a case runs past the time limit, or the worker's peak RSS grows past a bound.
Cases run in a worker subprocess watched by the parent, so crashes and hangs are caught and the input saved.

    python tools/fuzz_gguf.py -n 100000 --seed 1 --out /tmp/fuzz-crashes      # the long run
    python tools/fuzz_gguf.py -n 3000 --seed 0                                   # what CI runs (tests/test_fuzz_gguf.py)
    python tools/fuzz_gguf.py --deep -n 1000 --seed 2                            # and the deep run CI adds
    python tools/fuzz_gguf.py --semantic -n 600 --seed 4                         # well-formed files that lie

``--deep``: files that open are also fed to ModelConfig, every small tensor's dequantization, the tokenizer
(encode, decode, streaming decode), the chat template, and the public ``pyllm.load`` (n_ctx 32, reference backend)
with two greedy tokens; the report counts the cases that completed each stage.

Seeds: ``smollm2_head`` (the first 256 KiB of SmolLM2-135M, a real header cut short), ``smollm2_mini`` (SmolLM2's
real metadata with arrays cut to 64 entries and its full 272-entry tensor table with shapes shrunk and real data
bytes), ``all_types`` (every GGUF value type, nested arrays, one tensor of every ggml type, 1-4 dims, alignment 64)
and ``tiny_llama`` (pyllm.synthetic's random llama model, when that module is available). The SmolLM2 seeds are
used when the fixture is in the cache (``--smollm2 PATH`` or ~/.cache/pyllm/models).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A worker imports torch and runs every seed (pyllm.load included, with --deep) before its first case: 5-40 s on
# a loaded 2-core machine, and more than 120 s under nice 19 there, so the limit is generous.
WORKER_START_TIMEOUT = 600.0
HEAD_BYTES = 256 * 1024

# GGUF value types (gguf.h): scalar sizes; 8 = string, 9 = array.
_VSIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_VFMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


# ---------------------------------------------------------------------------------------------------------------
# A trusted walker and writer for GGUF bytes (independent of pyllm.formats.gguf, so a bug there can't hide itself here).
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Field:
    pos: int
    width: int  # 4 or 8
    kind: str  # version, n_tensors, n_kv, key_len, vtype, etype, count, str_len, scalar, name_len, n_dims, dim, ttype, toffset


@dataclass
class Layout:
    fields: list[Field] = field(default_factory=list)
    kv_spans: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of each complete KV entry
    tinfo_spans: list[tuple[int, int]] = field(default_factory=list)
    header_end: int = 0
    _by_kind: dict | None = None

    def by_kind(self) -> dict[str, list[Field]]:
        if self._by_kind is None:
            self._by_kind = {}
            for f in self.fields:
                self._by_kind.setdefault(f.kind, []).append(f)
        return self._by_kind


def walk(b: bytes) -> Layout:
    """Field map of a (trusted, possibly truncated) GGUF byte string: stops quietly where the bytes run out."""
    L = Layout()
    pos = 0

    def u(width, kind):
        nonlocal pos
        if pos + width > len(b):
            raise EOFError
        v = int.from_bytes(b[pos : pos + width], "little")
        L.fields.append(Field(pos, width, kind))
        pos += width
        return v

    def value(vt, depth=0):
        nonlocal pos
        if vt in _VSIZE:
            if pos + _VSIZE[vt] > len(b):
                raise EOFError
            if _VSIZE[vt] in (4, 8):
                L.fields.append(Field(pos, _VSIZE[vt], "scalar"))
            pos += _VSIZE[vt]
        elif vt == STRING:
            n = u(8, "str_len")
            pos += n
            if pos > len(b):
                raise EOFError
        elif vt == ARRAY:
            et = u(4, "etype")
            n = u(8, "count")
            if et in _VSIZE:
                if _VSIZE[et] in (4, 8) and n <= 64:
                    for k in range(n):
                        L.fields.append(Field(pos + k * _VSIZE[et], _VSIZE[et], "scalar"))
                pos += n * _VSIZE[et]
                if pos > len(b):
                    raise EOFError
            else:
                for _ in range(n):
                    value(et, depth + 1)
        else:
            raise ValueError(f"bad value type {vt}")

    try:
        pos = 4
        u(4, "version")
        nt = u(8, "n_tensors")
        nkv = u(8, "n_kv")
        for _ in range(nkv):
            s = pos
            kl = u(8, "key_len")
            pos += kl
            vt = u(4, "vtype")
            value(vt)
            L.kv_spans.append((s, pos))
        for _ in range(nt):
            s = pos
            nl = u(8, "name_len")
            pos += nl
            nd = u(4, "n_dims")
            for _ in range(nd):
                u(8, "dim")
            u(4, "ttype")
            u(8, "toffset")
            L.tinfo_spans.append((s, pos))
        L.header_end = pos
    except (EOFError, ValueError):
        L.header_end = pos
    return L


def _s(x: bytes | str) -> bytes:
    b = x.encode("utf-8", "surrogateescape") if isinstance(x, str) else x
    return struct.pack("<Q", len(b)) + b


def enc_value(vt: int, v) -> bytes:
    if vt in _VFMT:
        return struct.pack(_VFMT[vt], v)
    if vt == STRING:
        return _s(v)
    et, items = v
    out = struct.pack("<IQ", et, len(items))
    return out + b"".join(enc_value(et, x) for x in items)


def build(kvs, tinfos, data: bytes, *, version=3, alignment=32, n_tensors=None, n_kv=None) -> bytes:
    """kvs: [(key, vtype, value)] (array value = (etype, items)); tinfos: [(name, ne, type_id, rel_offset)]."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tinfos) if n_tensors is None else n_tensors,
                                          len(kvs) if n_kv is None else n_kv))
    for k, vt, v in kvs:
        out += _s(k) + struct.pack("<I", vt) + enc_value(vt, v)
    for name, ne, tt, off in tinfos:
        out += _s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        out += struct.pack("<IQ", tt, off)
    if alignment > 0:
        out += b"\0" * (-len(out) % alignment)
    return bytes(out) + data


def _block_info():
    from pyllm.formats.gguf import BLOCK_INFO

    return {int(k): v for k, v in BLOCK_INFO.items()}


def layout_tensors(specs, alignment=32, fill=None, rng=None):
    """specs: [(name, ne, type_id)] -> (tinfos, data) with aligned, non-overlapping, correctly sized data."""
    bi = _block_info()
    tinfos, data = [], bytearray()
    rng = rng or random.Random(0)
    for name, ne, tt in specs:
        bs, ts = bi[tt]
        n = ne[0] // bs * ts
        for d in ne[1:]:
            n *= d
        data += b"\0" * (-len(data) % alignment)
        tinfos.append((name, ne, tt, len(data)))
        data += fill(name, n) if fill else rng.randbytes(n)
    return tinfos, bytes(data)


# ---------------------------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------------------------


def find_smollm2(path: str | None = None) -> Path | None:
    cands = [path] if path else []
    cands += [os.path.join(os.environ.get("PYLLM_CACHE_DIR", ""), "models", SMOLLM2_NAME),
              os.path.expanduser(f"~/.cache/pyllm/models/{SMOLLM2_NAME}")]
    for c in cands:
        if c and os.path.isfile(c):
            return Path(c)
    return None


def _read_kvs(b: bytes, max_items: int = 64):
    """Typed KV list of a trusted GGUF (arrays cut to max_items) and its tensor table."""
    pos = 4 + 4
    nt, nkv = struct.unpack_from("<QQ", b, pos)
    pos += 16

    def s():
        nonlocal pos
        (n,) = struct.unpack_from("<Q", b, pos)
        v = b[pos + 8 : pos + 8 + n]
        pos += 8 + n
        return v

    def val(vt):
        nonlocal pos
        if vt in _VFMT:
            (v,) = struct.unpack_from(_VFMT[vt], b, pos)
            pos += _VSIZE[vt]
            return v
        if vt == STRING:
            return s()
        et, n = struct.unpack_from("<IQ", b, pos)
        pos += 12
        if et in _VSIZE:  # skip the tail of long scalar arrays without decoding it
            items = [struct.unpack_from(_VFMT[et], b, pos + i * _VSIZE[et])[0] for i in range(min(n, max_items))]
            pos += n * _VSIZE[et]
            return (et, items)
        items = [val(et) for _ in range(n)]
        return (et, items[:max_items])

    kvs = []
    for _ in range(nkv):
        k = s()
        (vt,) = struct.unpack_from("<I", b, pos)
        pos += 4
        kvs.append((k, vt, val(vt)))
    tinfos = []
    for _ in range(nt):
        name = s()
        (nd,) = struct.unpack_from("<I", b, pos)
        ne = list(struct.unpack_from(f"<{nd}Q", b, pos + 4))
        pos += 4 + 8 * nd
        tt, off = struct.unpack_from("<IQ", b, pos)
        pos += 12
        tinfos.append((name, ne, tt, off))
    align = 32
    for k, vt, v in kvs:
        if k == b"general.alignment" and vt in _VFMT:
            align = v
    data_start = (pos + align - 1) // align * align
    return kvs, tinfos, data_start


def seed_smollm2_mini(path: Path) -> bytes:
    """SmolLM2's real metadata (arrays cut to 64 entries, so vocab size no longer matches: fine for the reader) and
    its whole tensor table, each shape shrunk to two blocks x two rows, data copied from the real tensor."""
    bi = _block_info()
    with open(path, "rb") as f:
        head = f.read(4 << 20)
        kvs, tinfos, data_start = _read_kvs(head)
        specs, real = [], {}
        for name, ne, tt, off in tinfos:
            bs, ts = bi[tt]
            small = [min(ne[0], 2 * bs)] + [min(d, 2) for d in ne[1:]]
            specs.append((name, small, tt))
            f.seek(data_start + off)
            real[name] = f.read(4096)
    ti, data = layout_tensors(specs, fill=lambda name, n: (real[name] * (n // len(real[name]) + 1))[:n])
    return build(kvs, ti, data)


def seed_all_types() -> bytes:
    kvs = [
        ("general.architecture", STRING, "llama"),
        ("general.alignment", 4, 64),
        ("u8", 0, 200), ("i8", 1, -5), ("u16", 2, 60000), ("i16", 3, -300), ("u32", 4, 7), ("i32", 5, -7),
        ("f32", 6, 1.5), ("bool", 7, 1), ("u64", 10, 2**40), ("i64", 11, -(2**40)), ("f64", 12, 2.25),
        ("str", STRING, "héllo"), ("bad_utf8", STRING, b"\xff\xfe"),
        ("arr_i32", ARRAY, (5, [1, 2, 3, -4])), ("arr_str", ARRAY, (STRING, ["a", "bc", ""])),
        ("arr_bool", ARRAY, (7, [1, 0, 1])), ("arr_f64", ARRAY, (12, [0.5, 1e300])),
        ("nested", ARRAY, (ARRAY, [(4, [1, 2]), (STRING, ["x"]), (ARRAY, [(0, [9])])])),
        ("empty", ARRAY, (10, [])),
        ("tokenizer.chat_template", STRING, "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    ]
    bi = _block_info()
    specs = []
    shapes = [[1], [2, 3], [1, 2, 2], [1, 1, 2, 1]]
    for i, tt in enumerate(sorted(bi)):
        bs, _ = bi[tt]
        ne = list(shapes[i % 4])
        ne[0] *= bs
        specs.append((f"t{i}.type{tt}", ne, tt))
    ti, data = layout_tensors(specs, alignment=64, rng=random.Random(1))
    return build(kvs, ti, data, alignment=64)


def seed_tiny_llama() -> bytes | None:
    try:
        from pyllm import synthetic
    except Exception:
        return None
    with tempfile.TemporaryDirectory() as d:
        try:
            p = synthetic.write_tiny_llama(os.path.join(d, "tiny.gguf"), n_layer=1, n_embd=32, n_ff=64, n_head=2,
                                           n_kv_head=1, n_vocab=300, n_ctx=64, seed=0)
        except Exception:
            return None
        return Path(p).read_bytes()


def make_seeds(smollm2: str | None = None) -> dict[str, bytes]:
    seeds: dict[str, bytes] = {}
    p = find_smollm2(smollm2)
    if p is not None:
        with open(p, "rb") as f:
            seeds["smollm2_head"] = f.read(HEAD_BYTES)
        seeds["smollm2_mini"] = seed_smollm2_mini(p)
    seeds["all_types"] = seed_all_types()
    t = seed_tiny_llama()
    if t is not None:
        seeds["tiny_llama"] = t
    return seeds


# ---------------------------------------------------------------------------------------------------------------
# Mutations
# ---------------------------------------------------------------------------------------------------------------

INTERESTING = [0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 33, 63, 64, 127, 128, 255, 256, 1023, 4096, 65535, 65536,
               2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**48, 2**62, 2**63 - 1, 2**63, 2**64 - 32, 2**64 - 1]
KIND_WEIGHTS = {"version": 1, "n_tensors": 3, "n_kv": 3, "key_len": 2, "vtype": 3, "etype": 3, "count": 3,
                "str_len": 2, "scalar": 2, "name_len": 2, "n_dims": 3, "dim": 4, "ttype": 3, "toffset": 4}


def _interesting(rng: random.Random, width: int, orig: int, size: int) -> int:
    r = rng.random()
    if r < 0.45:
        v = rng.choice(INTERESTING)
    elif r < 0.65:
        v = orig + rng.choice([-2, -1, 1, 2, 31, 32, -32, 64])
    elif r < 0.75:
        v = orig << rng.randint(1, 40)
    elif r < 0.9:
        v = size + rng.randint(-64, 64)
    else:
        v = rng.getrandbits(width * 8)
    return v % (1 << (width * 8))


def _put(b: bytearray, pos: int, width: int, v: int) -> None:
    if pos + width <= len(b):
        b[pos : pos + width] = v.to_bytes(width, "little")


def mutate(seed_bytes: bytes, layout: Layout, rng: random.Random) -> tuple[bytes, list[str]]:
    b = bytearray(seed_bytes)
    ops: list[str] = []
    n_ops = 1 + min(int(rng.expovariate(0.9)), 6)
    # Field-targeted ops first (their positions are from the seed), size-changing ops after.
    structural, resizing = [], []
    for _ in range(n_ops):
        op = rng.choices(["field", "type", "bitflip", "byte", "truncate", "insert", "delete", "dup", "append",
                          "swap_entries"], weights=[30, 10, 14, 8, 8, 5, 5, 5, 3, 4])[0]
        (resizing if op in ("truncate", "insert", "delete", "dup", "append", "swap_entries") else structural).append(op)
    by_kind = layout.by_kind()
    kinds = [k for k in KIND_WEIGHTS if k in by_kind]
    for op in structural:
        if op == "field" and kinds:
            k = rng.choices(kinds, weights=[KIND_WEIGHTS[x] for x in kinds])[0]
            f = rng.choice(by_kind[k])
            orig = int.from_bytes(b[f.pos : f.pos + f.width], "little")
            v = _interesting(rng, f.width, orig, len(b))
            _put(b, f.pos, f.width, v)
            ops.append(f"set {k}@{f.pos}={v}")
        elif op == "type" and any(k in by_kind for k in ("vtype", "etype", "ttype")):
            k = rng.choice([k for k in ("vtype", "etype", "ttype") if k in by_kind])
            f = rng.choice(by_kind[k])
            v = rng.choice(list(range(0, 42)) + [2**31, 2**32 - 1])
            _put(b, f.pos, 4, v)
            ops.append(f"type {k}@{f.pos}={v}")
        elif op == "bitflip" or op in ("field", "type"):
            # bias flips toward the header, where the structure is
            end = max(min(len(b), layout.header_end + 64), 1)
            pos = rng.randrange(end) if rng.random() < 0.85 else rng.randrange(max(len(b), 1))
            if pos < len(b):
                b[pos] ^= 1 << rng.randrange(8)
            ops.append(f"flip@{pos}")
        elif op == "byte":
            pos = rng.randrange(max(min(len(b), layout.header_end + 64), 1))
            if pos < len(b):
                b[pos] = rng.choice([0, 0xFF, 0x7F, 0x80, rng.getrandbits(8)])
            ops.append(f"byte@{pos}")
    for op in resizing:
        n = len(b)
        if op == "truncate" and n:
            if rng.random() < 0.5 and layout.fields:
                cut = rng.choice(layout.fields).pos + rng.randint(0, 8)
            else:
                cut = rng.randrange(n)
            del b[cut:]
            ops.append(f"truncate@{cut}")
        elif op == "insert":
            pos = rng.randrange(n + 1)
            b[pos:pos] = bytes(rng.getrandbits(8) for _ in range(rng.choice([1, 4, 8, 12, 33])))
            ops.append(f"insert@{pos}")
        elif op == "delete" and n:
            pos = rng.randrange(n)
            k = rng.choice([1, 4, 8, 12, 64])
            del b[pos : pos + k]
            ops.append(f"delete@{pos}+{k}")
        elif op == "dup" and n:
            pos = rng.randrange(n)
            k = rng.choice([4, 8, 16, 100])
            dst = rng.randrange(n)
            b[dst:dst] = b[pos : pos + k]
            ops.append(f"dup {pos}+{k}->{dst}")
        elif op == "append":
            b += bytes(rng.getrandbits(8) for _ in range(rng.choice([1, 16, 1000])))
            ops.append("append")
        elif op == "swap_entries":
            spans = layout.tinfo_spans if (layout.tinfo_spans and rng.random() < 0.5) else layout.kv_spans
            if len(spans) >= 2 and spans[-1][1] <= n:
                i, j = sorted(rng.sample(range(len(spans)), 2))
                (s1, e1), (s2, e2) = spans[i], spans[j]
                if rng.random() < 0.5:  # swap two entries (lengths may differ: everything after shifts)
                    b[s1:e2] = b[s2:e2] + b[e1:s2] + b[s1:e1]
                    ops.append(f"swap entries {i},{j}")
                else:  # duplicate an entry over another (duplicate keys / tensor names)
                    b[s2:e2] = b[s1:e1]
                    ops.append(f"copy entry {i}->{j}")
    return bytes(b), ops


def random_table(rng: random.Random) -> tuple[bytes, list[str]]:
    """A file built from scratch with a random tensor table (and random alignment / counts / data size)."""
    bi = _block_info()
    tids = sorted(bi)
    kvs = []
    r = rng.random()
    if r < 0.5:
        kvs.append(("general.alignment", 4, rng.choice([1, 2, 16, 32, 64, 4096])))
    elif r < 0.6:
        kvs.append(("general.alignment", rng.choice([4, 10]), rng.choice([0, 3, 24, 2**31])))
    elif r < 0.65:
        kvs.append(("general.alignment", *rng.choice([(7, 1), (STRING, "32"), (6, 32.0), (11, -32)])))
    alignment = next((v for k, t, v in kvs if k == "general.alignment" and t in (4, 10, 5) and isinstance(v, int)), 32)
    if alignment <= 0 or alignment & (alignment - 1) or alignment > 4096:
        alignment_pad = 32
    else:
        alignment_pad = alignment
    n = rng.choice([0, 1, 2, 3, 5, 8])
    names = [rng.choice([f"t{i}", "t0", "", "blk.0.attn_q.weight", "\udcff"]) if rng.random() < 0.2 else f"t{i}"
             for i in range(n)]
    specs, tinfos = [], []
    for name in names:
        tt = rng.choice(tids) if rng.random() < 0.85 else rng.choice([31, 32, 33, 36, 40, 41, 1000, 2**32 - 1])
        bs = bi.get(tt, (1, 1))[0]
        nd = rng.choice([1, 1, 2, 2, 2, 3, 4]) if rng.random() < 0.9 else rng.choice([0, 5, 8, 2**32 - 1])
        ne = []
        for d in range(min(nd, 8)):
            if rng.random() < 0.85:
                ne.append(rng.choice([1, 2, 3, 4, 8]) * (bs if d == 0 else 1))
            else:
                ne.append(rng.choice([0, bs - 1 if bs > 1 else 3, 2**31, 2**32, 2**40 + 1, 2**63, 2**64 - 1]))
        specs.append((name, ne, tt))
    # offsets: correct layout, then maybe disturbed
    def sane(ne, tt):  # the shape the data is laid out for: the real one when valid and small, else one block
        if tt not in bi or not 1 <= len(ne) <= 4 or ne[0] % bi[tt][0]:
            return [bi.get(tt, (1, 1))[0]], (tt if tt in bi else 0)
        n = 1
        for d in ne:
            n *= d
        return (list(ne) if 0 < n <= 1 << 16 else [bi[tt][0]]), tt

    good, data = layout_tensors([(nm, *sane(ne, tt)) for nm, ne, tt in specs], alignment=alignment_pad, rng=rng)
    for (nm, ne, tt), (_, _, _, off) in zip(specs, good):
        r = rng.random()
        if r < 0.75:
            pass
        elif r < 0.85:
            off = rng.choice([0, 1, 16, 32, 33, len(data), len(data) + 32, 2**63, 2**64 - 32])
        else:
            off = max(off - rng.choice([1, 32, 64]), 0)  # overlap the previous tensor
        tinfos.append((nm, ne, tt, off))
    r = rng.random()
    if r < 0.1:
        data = data[: rng.randrange(len(data) + 1)]
    elif r < 0.15:
        data += bytes(rng.randrange(100))
    n_tensors = None if rng.random() < 0.9 else rng.choice([0, n + 1, 2**63, max(n - 1, 0)])
    out = build(kvs, tinfos, data, alignment=alignment_pad, n_tensors=n_tensors,
                version=3 if rng.random() < 0.95 else rng.choice([1, 2, 4, 3 << 24]))
    return out, [f"random table n={n} align={alignment}"]


# ---------------------------------------------------------------------------------------------------------------
# Semantic mode: well-formed files whose values lie
# ---------------------------------------------------------------------------------------------------------------

# A few templates that do their damage in one built-in call or at compile time (tests/test_template_bombs.py has
# the full corpus); a lying file may carry any of them.
BOMB_TEMPLATES = [
    "{% set x = namespace(v=10**4000) %}{% for i in range(40) %}{% set x.v = x.v * x.v %}{% endfor %}{{ x.v }}",
    "{% set s = namespace(v='ab') %}{% for i in range(40) %}{% set s.v = s.v ~ s.v %}{% endfor %}{{ s.v }}",
    "{{ 'x'|center(999999) ~ 'y'|center(999999) }}",
    "{{ ('a\n' * 100000)|indent('p' * 100000, true) }}",
    "{{ range(100000)|join('s' * 1000000) }}",
    "{{ [[1]]|tojson(indent=100000000) }}",
    "{{ " + "(" * 300 + "1" + ")" * 300 + " }}",
    "{% if true %}" * 300 + "x" + "{% endif %}" * 300,
    "{{ messages[0]['content'] ~ '<|im_start|>system' }}",
]


def _lie(rng: random.Random, vt: int, v):
    """A (type, value) of the same key that is well-formed but wrong: another type, or a value out of range."""
    choices = [
        (STRING, "12"), (STRING, ""), (STRING, "\u00e9" * rng.randint(1, 4)), (7, rng.randint(0, 1)),
        (6, float("nan")), (6, float("inf")), (6, float("-inf")), (6, 0.0), (6, -1.0), (6, 1e30), (12, 1e-300),
        (4, 0), (4, 1), (4, 2**31), (4, 2**32 - 1), (5, -1), (10, 2**63), (10, 2**64 - 1), (11, -(2**63)),
        (ARRAY, (STRING, ["a", "b"])), (ARRAY, (4, [])), (ARRAY, (4, [7] * rng.randint(1, 40))),
        (ARRAY, (4, [rng.randint(0, 9) for _ in range(rng.randint(2, 40))])), (ARRAY, (ARRAY, [(4, [1]), (4, [2])])),
    ]
    if vt in _VFMT and vt not in (6, 12, 7) and isinstance(v, int):  # an integer near the original
        # kept inside the field's range (a first lie of 2**63 in a u64 cannot be doubled)
        choices += [(vt, max(0, v + d)) for d in (-v, -1, 1, v, 3 * v) if v + d < 2 ** (8 * _VSIZE[vt] - 1)]
        choices += [(vt, v * 2**k) for k in (8, 16) if v * 2**k < 2 ** (8 * _VSIZE[vt] - 1)]
    return rng.choice(choices)


def semantic_mutate(seed_bytes: bytes, rng: random.Random) -> tuple[bytes, list[str]]:
    """One to three semantic lies in a trusted model file (the tiny llama seed), rebuilt as a well-formed GGUF:
    hyper-parameters of another type or out of range, missing keys, another architecture, vocabularies longer or
    shorter than the embedding, token types/scores/merges that do not match, special ids out of range, a
    template bomb, NaN/Inf written into float weights or quantized block scales, and tensors whose shapes lie
    while their data stays in place (fewer rows, swapped dimensions)."""
    kvs, tinfos, data_start = _read_kvs(seed_bytes, max_items=1 << 30)
    kvs = [(k.decode() if isinstance(k, bytes) else k, vt, v) for k, vt, v in kvs]
    kvs = [(k, vt, v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else v) for k, vt, v in kvs]
    kvs = [(k, vt, (v[0], [x.decode("utf-8", "surrogateescape") if isinstance(x, bytes) else x for x in v[1]])
            if vt == ARRAY else v) for k, vt, v in kvs]
    tinfos = [(n.decode("utf-8", "surrogateescape"), list(ne), tt, off) for n, ne, tt, off in tinfos]
    data = bytearray(seed_bytes[data_start:])
    arch = next(v for k, vt, v in kvs if k == "general.architecture")
    bi = _block_info()
    ops = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        r = rng.random()
        keys = [k for k, _, _ in kvs]
        if r < 0.40:  # a hyper-parameter or tokenizer scalar lies
            cands = [j for j, (k, vt, v) in enumerate(kvs) if k.startswith(arch + ".") or
                     (k.startswith("tokenizer.ggml.") and vt != ARRAY)]
            j = rng.choice(cands)
            k, vt, v = kvs[j]
            nvt, nv = _lie(rng, vt, v)
            kvs[j] = (k, nvt, nv)
            ops.append(f"{k}: {vt}:{str(v)[:20]} -> {nvt}:{str(nv)[:40]}")
        elif r < 0.48:  # a key goes missing
            j = rng.randrange(len(kvs))
            ops.append(f"drop {kvs[j][0]}")
            del kvs[j]
        elif r < 0.53:  # another architecture over the llama keys
            new = rng.choice(["qwen2", "qwen3", "gemma3", "phi3", "mistral", "granite", "mamba", "", "llama\x00"])
            kvs = [(k, vt, new if k == "general.architecture" else v) for k, vt, v in kvs]
            ops.append(f"architecture -> {new!r}")
        elif r < 0.68:  # vocabulary arrays that disagree with each other or with the embedding
            name = rng.choice(["tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                               "tokenizer.ggml.scores"])
            j = keys.index(name) if name in keys else None
            if j is None:
                kvs.append((name, ARRAY, (6, [0.0] * rng.choice([1, 300, 400]))))
                ops.append(f"add {name}")
                continue
            k, vt, (et, items) = kvs[j]
            how = rng.choice(["grow", "shrink", "empty", "dup", "retype"])
            if how == "grow":
                extra = [items[-1] if et != STRING else f"<|lie_{n}|>" for n in range(rng.choice([1, 16, 300]))]
                items = items + extra
            elif how == "shrink":
                items = items[:rng.randint(0, len(items) - 1)]
            elif how == "empty":
                items = []
            elif how == "dup":
                items = items + items[: rng.randint(1, 20)]
            else:
                et, items = (STRING, [str(x) for x in items]) if et != STRING else (4, list(range(len(items))))
            kvs[j] = (k, vt, (et, items))
            ops.append(f"{name} {how} -> {len(items)} items")
        elif r < 0.73:  # the chat template is a bomb
            kvs = [x for x in kvs if x[0] != "tokenizer.chat_template"]
            t = rng.choice(BOMB_TEMPLATES)
            kvs.append(("tokenizer.chat_template", STRING, t))
            ops.append(f"template bomb {t[:30]!r}")
        elif r < 0.88:  # NaN / Inf in the weights
            j = rng.randrange(len(tinfos))
            name, ne, tt, off = tinfos[j]
            bs, ts = bi[tt]
            val = rng.choice([float("nan"), float("inf"), float("-inf")])
            if tt == 0:  # F32: any element
                n = 1
                for d in ne:
                    n *= d
                at = off + 4 * rng.randrange(n)
                data[at:at + 4] = struct.pack("<f", val)
            elif tt in (1, 8, 2, 3):  # F16, and Q8_0/Q4_0/Q4_1, whose blocks start with an fp16 scale
                at = off + (2 * rng.randrange(ne[0]) if tt == 1 else ts * rng.randrange(max(ne[0] // bs, 1)))
                data[at:at + 2] = struct.pack("<e", val)
            else:
                continue
            ops.append(f"{val} in {name}")
        else:  # a shape that lies while the data stays where it is
            j = rng.randrange(len(tinfos))
            name, ne, tt, off = tinfos[j]
            bs, _ = bi[tt]
            if len(ne) == 2 and rng.random() < 0.5 and ne[1] > 1:
                ne = [ne[0], rng.randint(1, ne[1] - 1)]  # fewer rows
            elif len(ne) == 2 and ne[1] % bs == 0:
                ne = [ne[1], ne[0]]  # transposed (same size)
            else:
                ne = [ne[0]] + [1] * rng.randint(0, 2)
            tinfos[j] = (name, ne, tt, off)
            ops.append(f"{name} shape -> {ne}")
    align = next((v for k, vt, v in kvs if k == "general.alignment" and isinstance(v, int)), 32)
    return build(kvs, tinfos, bytes(data), alignment=align), ops


class CaseMaker:
    """Deterministic case generator: case(i) depends only on (seed, i) and the seed files."""

    def __init__(self, seeds: dict[str, bytes], seed: int, semantic: bool = False):
        self.seeds = seeds
        self.names = sorted(seeds)
        self.layouts = {k: walk(v) for k, v in seeds.items()}
        self.seed = seed
        self.semantic = semantic
        self.weights = {"smollm2_head": 2, "smollm2_mini": 4, "all_types": 3, "tiny_llama": 3}

    def case(self, i: int) -> tuple[bytes, str]:
        h = hashlib.sha256(f"{self.seed}:{i}".encode()).digest()
        rng = random.Random(int.from_bytes(h[:8], "little"))
        if self.semantic:
            data, ops = semantic_mutate(self.seeds["tiny_llama"], rng)
            return data, "tiny_llama semantic: " + "; ".join(ops)
        if rng.random() < 0.12:
            data, ops = random_table(rng)
            return data, "; ".join(ops)
        name = rng.choices(self.names, weights=[self.weights.get(n, 1) for n in self.names])[0]
        if rng.random() < 0.02:
            return self.seeds[name], f"{name} unmodified"
        data, ops = mutate(self.seeds[name], self.layouts[name], rng)
        return data, f"{name}: " + "; ".join(ops)


# ---------------------------------------------------------------------------------------------------------------
# Running one case (in the worker)
# ---------------------------------------------------------------------------------------------------------------


class Broken(Exception):
    """A promise of the reader does not hold for a file it accepted."""


def _check_opened(gf, size: int) -> None:
    from pyllm.formats.gguf import BLOCK_INFO

    spans = []
    for name, t in gf.tensors.items():
        bs, ts = BLOCK_INFO[t.ggml_type]
        n_el = 1
        for d in t.shape:
            if d < 1:
                raise Broken(f"tensor {name!r} has dimension {d}")
            n_el *= d
        if t.shape[-1] % bs or t.nbytes != n_el // bs * ts:
            raise Broken(f"tensor {name!r}: nbytes {t.nbytes} does not match {t.ggml_type.name} {t.shape}")
        if t.offset < gf.data_offset or t.offset + t.nbytes > size or (t.offset - gf.data_offset) % gf.alignment:
            raise Broken(f"tensor {name!r}: range {t.offset}+{t.nbytes} outside/unaligned (file {size} bytes)")
        spans.append((t.offset, t.offset + t.nbytes, name))
    spans.sort()
    for a, b in zip(spans, spans[1:]):
        if b[0] < a[1]:
            raise Broken(f"tensors {a[2]!r} and {b[2]!r} overlap")


def _touch(v) -> int:
    flat = v.reshape(-1)
    n = flat.numel()
    if n == 0:
        return 0
    s = int(flat[0]) + int(flat[-1])
    if n <= 1 << 20:
        s += int(flat.sum())
    return s


def _deep(gf, path: str, reached: set) -> None:
    """The layers above the reader, fed a file that opened: config, dequantization, tokenizer (encode, decode,
    streaming decode), chat template, then the public ``pyllm.load`` (small n_ctx, reference backend) and two
    greedy tokens. ``reached`` collects the stages that ran to completion (the report counts them, so a CI run
    shows it reached each layer). A PyllmError from any stage ends that stage; anything else escapes."""
    from pyllm.errors import PyllmError
    from pyllm.models.config import ModelConfig

    try:
        ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=os.path.basename(path))
        reached.add("config")
    except PyllmError:
        pass
    from pyllm.formats.gguf import COMPUTE_TYPES
    from pyllm.formats.quant import qtensor_from_gguf

    for name, t in gf.tensors.items():
        if t.ggml_type in COMPUTE_TYPES and t.nbytes <= 1 << 16:
            qtensor_from_gguf(gf, name).dequantize()
            reached.add("dequantize")
    from pyllm.chat_template import ChatTemplate
    from pyllm.tokenizer import StreamDecoder, Tokenizer

    if "tokenizer.ggml.tokens" in gf.metadata and len(gf.metadata.get("tokenizer.ggml.tokens") or ()) < 5000:
        try:
            tok = Tokenizer.from_gguf(gf.metadata)
        except PyllmError:
            tok = None
        if tok is not None:
            reached.add("tokenizer")
            for text in ("Hello, world! héllo 123", "<|im_start|>user\n\u00e9\U0001f327\ufe0f<s></s>\t  x"):
                ids = tok.encode(text)
                tok.decode(ids)
                tok.decode(ids, skip_special=True)
                dec = StreamDecoder(tok)
                "".join(dec.push(i) for i in ids) + dec.flush()
            tok.decode(list(range(min(tok.n_vocab, 64))))  # every kind of token, special ones too
            reached.add("encode/decode")
            tmpl = ChatTemplate.from_metadata(gf.metadata, tok)
            try:
                tmpl.render([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}])
                reached.add("template")
            except PyllmError:
                pass
    import pyllm

    try:
        llm = pyllm.load(path, n_ctx=32, kernels="reference", kv_cache="f32")
    except PyllmError:
        return
    reached.add("load")
    try:
        llm.generate([0], max_tokens=2, temperature=0.0)
        reached.add("generate")
    except PyllmError:
        pass
    finally:
        llm.close()


def _reason(msg: str, path: str) -> str:
    """The kind of a rejection: the message without the path, quoted names and numbers (a coverage measure)."""
    import re

    msg = msg.replace(path, "")
    msg = re.sub(r"'[^']*'|\"[^\"]*\"|b'[^']*'", "Q", msg)
    msg = re.sub(r"\[[^\]]*\]", "L", msg)
    msg = re.sub(r"\d+", "N", msg)
    return " ".join(msg.lstrip(": ").split()[:8])


def run_one(data: bytes, path: str, deep: bool, reached: set | None = None) -> tuple[str, str]:
    """Returns ("opened", "") or ("rejected", reason); raises anything else (the worker reports it as a failure).
    ``reached``: with ``deep``, collects the deep stages that completed."""
    from pyllm.errors import PyllmError
    from pyllm.formats.gguf import open_gguf

    try:
        os.unlink(path)  # a fresh inode: never rewrite a file some stale mapping may still point at
    except FileNotFoundError:
        pass
    with open(path, "wb") as f:
        f.write(data)
    try:
        gf = open_gguf(path)
    except PyllmError as e:
        return "rejected", _reason(str(e), path)
    try:
        _check_opened(gf, len(data))
        for name in gf.tensors:
            _touch(gf.raw(name))
        gf.get("general.architecture")
        repr(gf)
        if deep:
            try:
                _deep(gf, path, set() if reached is None else reached)
            except PyllmError:
                pass
    finally:
        gf.close()
    return "opened", ""


def _rss_kb() -> tuple[int, int]:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open("/proc/self/statm") as f:
        cur = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    return cur, peak


def worker_main(args) -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the library prints goes to stderr, never into the protocol
    seeds = {p.stem: p.read_bytes() for p in Path(args.seed_dir).glob("*.gguf")}
    maker = CaseMaker(seeds, args.seed, semantic=args.semantic)
    args.deep = args.deep or args.semantic
    path = os.path.join(args.work_dir, f"case-{os.getpid()}.gguf")
    # PYLLM_FUZZ_SELFTEST="raise:3,crash:7,hang:12": misbehave on those cases (tests that the harness notices)
    selftest = {int(i): k for k, _, i in (e.partition(":") for e in os.environ.get("PYLLM_FUZZ_SELFTEST", "").split(",") if e)}
    # warm up imports so the RSS baseline includes them
    for k in sorted(seeds):
        run_one(seeds[k], path, args.deep)
    _, base_peak = _rss_kb()
    out.write(json.dumps({"ready": True, "base_peak_kb": base_peak}) + "\n")
    for line in sys.stdin:
        start, count = map(int, line.split())
        for i in range(start, start + count):
            t0 = time.perf_counter()
            res = {"i": i}
            try:
                data, _ = maker.case(i)
                st_kind = selftest.get(i)
                if st_kind == "raise":
                    raise IndexError("self-test")
                if st_kind == "hang":
                    time.sleep(3600)
                if st_kind == "crash":
                    os.kill(os.getpid(), signal.SIGSEGV)
                reached = set()
                res["outcome"], res["reason"] = run_one(data, path, args.deep, reached)
                if reached:
                    res["stages"] = sorted(reached)
            except BaseException as e:  # noqa: BLE001 - everything that is not a PyllmError is a finding
                res["outcome"] = "error"
                res["error"] = f"{type(e).__name__}: {e}"[:500]
                res["tb"] = traceback.format_exc()[-3000:]
            res["t"] = time.perf_counter() - t0
            cur, peak = _rss_kb()
            res["rss_kb"], res["peak_kb"] = cur, peak
            if peak - base_peak > args.rss_limit_mb * 1024:
                res["outcome"] = "memory"
                res["error"] = f"peak RSS grew by {(peak - base_peak) / 1024:.0f} MiB (limit {args.rss_limit_mb} MiB)"
            out.write(json.dumps(res) + "\n")
        out.write(json.dumps({"batch_done": start}) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# The parent: drives workers, watches for crashes and hangs, saves failing inputs
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Report:
    cases: int = 0
    opened: int = 0
    rejected: int = 0
    failures: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    max_case_seconds: float = 0.0
    max_rss_growth_mb: float = 0.0
    restarts: int = 0
    seeds: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)  # rejection kinds (message shapes) and their counts
    stages: dict[str, int] = field(default_factory=dict)  # --deep: cases that completed each stage

    def summary(self) -> str:
        s = (f"{self.cases} cases in {self.seconds:.1f} s: {self.opened} opened, {self.rejected} rejected with "
             f"PyllmError, {len(self.failures)} failures; slowest case {self.max_case_seconds * 1000:.0f} ms; worker "
             f"peak RSS growth {self.max_rss_growth_mb:.1f} MiB; {len(self.reasons)} kinds of rejection; "
             f"seeds {self.seeds}" + (f"; deep stages completed {self.stages}" if self.stages else ""))
        for f in self.failures[:20]:
            s += f"\n  FAIL case {f['i']} [{f['kind']}] {f.get('error', '')} ({f.get('desc', '')}) {f.get('saved', '')}"
        return s


class _Worker:
    def __init__(self, seed_dir, work_dir, seed, deep, rss_limit_mb, env, semantic=False):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--seed-dir", seed_dir, "--work-dir",
               work_dir, "--seed", str(seed), "--rss-limit-mb", str(rss_limit_mb)] + (["--deep"] if deep else [])
        cmd += ["--semantic"] if semantic else []
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=False)
        self.buf = b""
        hello = self.read(WORKER_START_TIMEOUT)
        if hello is None or not hello.get("ready"):
            self.kill()
            raise RuntimeError(f"fuzz worker failed to start (exit {self.p.poll()})")
        self.base_peak_kb = hello["base_peak_kb"]

    def send(self, start, count):
        self.p.stdin.write(f"{start} {count}\n".encode())
        self.p.stdin.flush()

    def read(self, timeout):
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([self.p.stdout], [], [], left)
            if not r:
                return None
            chunk = os.read(self.p.stdout.fileno(), 1 << 16)
            if not chunk:
                return "eof"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


def fuzz(n_cases: int, seed: int = 0, *, case_timeout: float = 10.0, rss_limit_mb: int = 256, deep: bool = False,
         smollm2: str | None = None, out_dir: str | None = None, batch: int = 200, progress: bool = False,
         env: dict | None = None, start: int = 0, seeds: dict[str, bytes] | None = None,
         semantic: bool = False) -> Report:
    rep = Report()
    t0 = time.perf_counter()
    seeds = make_seeds(smollm2) if seeds is None else seeds
    if semantic:
        seeds = {"tiny_llama": seeds.get("tiny_llama") or seed_tiny_llama()}
        deep = True
    rep.seeds = {k: len(v) for k, v in seeds.items()}
    maker = CaseMaker(seeds, seed, semantic=semantic)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="pyllm-fuzz-seeds-") as seed_dir, \
            tempfile.TemporaryDirectory(prefix="pyllm-fuzz-", dir=shm) as work_dir:
        for k, v in seeds.items():
            Path(seed_dir, f"{k}.gguf").write_bytes(v)
        wenv = dict(os.environ if env is None else env)
        wenv["PYTHONPATH"] = str(REPO) + os.pathsep + wenv.get("PYTHONPATH", "")
        wenv.setdefault("OMP_NUM_THREADS", "1")
        w = _Worker(seed_dir, work_dir, seed, deep, rss_limit_mb, wenv, semantic)
        i, end = start, start + n_cases
        last_print = time.monotonic()

        def fail(idx, kind, **kw):
            data, desc = maker.case(idx)
            f = {"i": idx, "kind": kind, "desc": desc, **kw}
            if out_dir:
                os.makedirs(out_dir, exist_ok=True)
                p = Path(out_dir, f"seed{seed}-case{idx}.gguf")
                p.write_bytes(data)
                Path(out_dir, f"seed{seed}-case{idx}.txt").write_text(json.dumps(f, indent=1))
                f["saved"] = str(p)
            rep.failures.append(f)

        while i < end:
            count = min(batch, end - i)
            w.send(i, count)
            expect = i
            while expect < i + count:
                msg = w.read(case_timeout)
                if msg is None or msg == "eof":
                    rc = w.p.poll()
                    if msg is None:
                        kind, err = "hang", f"no result within {case_timeout} s"
                    else:
                        rc = w.p.wait()
                        kind = "crash"
                        err = f"worker died: {'signal ' + signal.Signals(-rc).name if rc and rc < 0 else f'exit {rc}'}"
                    w.kill()
                    fail(expect, kind, error=err)
                    rep.cases += 1
                    i = expect + 1
                    if i < end:
                        rep.restarts += 1
                        w = _Worker(seed_dir, work_dir, seed, deep, rss_limit_mb, wenv, semantic)
                    break
                rep.cases += 1
                rep.max_case_seconds = max(rep.max_case_seconds, msg["t"])
                rep.max_rss_growth_mb = max(rep.max_rss_growth_mb, (msg["peak_kb"] - w.base_peak_kb) / 1024)
                for st in msg.get("stages", ()):
                    rep.stages[st] = rep.stages.get(st, 0) + 1
                if msg["outcome"] == "opened":
                    rep.opened += 1
                elif msg["outcome"] == "rejected":
                    rep.rejected += 1
                    rep.reasons[msg["reason"]] = rep.reasons.get(msg["reason"], 0) + 1
                else:
                    fail(msg["i"], msg["outcome"], error=msg.get("error"), tb=msg.get("tb"))
                    if msg["outcome"] == "memory":  # a fresh worker, so the next cases get a fresh baseline
                        w.kill()
                        i = msg["i"] + 1
                        if i < end:
                            rep.restarts += 1
                            w = _Worker(seed_dir, work_dir, seed, deep, rss_limit_mb, wenv, semantic)
                        break
                expect += 1
            else:
                done = w.read(case_timeout)
                if not (isinstance(done, dict) and "batch_done" in done):
                    raise RuntimeError(f"fuzz worker protocol error: {done!r}")
                i += count
            if progress and time.monotonic() - last_print > 10:
                last_print = time.monotonic()
                print(f"[fuzz] {rep.cases}/{n_cases} cases, {rep.opened} opened, {len(rep.failures)} failures, "
                      f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        if w.p.poll() is None:
            w.p.stdin.close()
        w.kill()
    rep.seconds = time.perf_counter() - t0
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first case index (to replay one case: --start I -n 1)")
    ap.add_argument("--timeout", type=float, default=10.0, help="per-case time limit, seconds")
    ap.add_argument("--rss-limit-mb", type=int, default=256, help="allowed growth of the worker's peak RSS")
    ap.add_argument("--deep", action="store_true", help="files that open also go through config, dequantization, "
                    "tokenizer, chat template and pyllm.load + 2 greedy tokens")
    ap.add_argument("--semantic", action="store_true", help="well-formed files whose values lie (hyper-parameters "
                    "of the wrong type or range, vocabularies that disagree with the embedding, NaN weights, "
                    "template bombs, shapes that lie), each taken through --deep")
    ap.add_argument("--smollm2", default=None, help="path of SmolLM2-135M-Instruct.Q4_1.gguf (default: the cache)")
    ap.add_argument("--out", default=None, help="directory for failing inputs")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed-dir", help=argparse.SUPPRESS)
    ap.add_argument("--work-dir", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker_main(a)
        return 0
    rep = fuzz(a.cases, a.seed, case_timeout=a.timeout, rss_limit_mb=a.rss_limit_mb, deep=a.deep, smollm2=a.smollm2,
               out_dir=a.out, progress=True, start=a.start, semantic=a.semantic)
    if a.json:
        d = dict(rep.__dict__)
        print(json.dumps(d, indent=1, default=str))
    else:
        print(rep.summary())
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
