"""The on-disk prompt cache of the server's slots (``serve --prompt-cache DIR``) and the unit of prompt reuse.

A slot's rows are reusable in whole prefill chunks only (``reusable``), so a prompt's last partial chunk is always
computed as a fresh prefill computes it; the cache keeps such rows in safetensors files keyed by the model's sha256
and the cache layout, checked (format, digest, layout, token count) before a row is read back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..safe_io import private_tempfile
from .engine import common_prefix

if TYPE_CHECKING:
    from .slots import Slot

PREFILL_CHUNK = 64  # prompt tokens per forward pass of a slot's prefill; also the unit of prompt reuse


def reusable(common: int, n_ids: int, exact: int) -> int:
    """Rows of a cache that a prompt of ``n_ids`` tokens may reuse: whole prefill chunks within the ``common``
    prefix and the cache's ``exact`` rows, leaving at least the last prompt token to evaluate (its logits)."""
    n = min(common, n_ids - 1, exact)
    return n - n % PREFILL_CHUNK


# ------------------------------------------------------------------------------------------------ disk cache
MAX_CACHED_TOKENS = 1 << 24  # the largest --ctx
FORMAT = "pyllm-prompt-cache/2"  # /2: the header holds the tensors' sha256 (/1 files are ignored as another format)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of the tensors' names, dtypes, shapes and bytes, in name order: what a prompt-cache file must hold."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _regular_file(p: Path) -> None:
    """ValueError unless ``p`` (after symlinks) is a regular file: a FIFO would block the open, with the GIL held
    in safetensors' native code, stopping the whole server; a device or directory is no cache file either."""
    if not stat.S_ISREG(os.stat(p).st_mode):
        raise ValueError("not a regular file")


def log(msg: str) -> None:
    print(f"pyllm serve: prompt cache: {msg}", file=sys.stderr, flush=True)


@dataclass
class _Entry:
    path: Path
    tokens: tuple
    size: int
    used: float


class PromptCache:
    """KV prefixes on disk across restarts: one safetensors file per prefix (a slot's rows 0..n-1 and its
    statistics), named by sha256(model sha256, tokens) and labelled with the model's sha256, the cache kind and
    shape, the tokens and the tensors' sha256. Bounded: past ``max_bytes`` the least recently used files are
    deleted. A file that is not a regular file, unreadable, truncated, from another model or cache layout, whose
    tensors have other shapes than its token count gives, whose bytes do not match its digest or whose float
    tensors hold NaN/Inf is named in one log line and ignored: damage never reaches a request."""

    def __init__(self, directory, model_sha256: str, kv_template, max_bytes: int = 1 << 30):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sha = model_sha256
        self.max_bytes = max_bytes
        self.layout = kv_template.state_layout()  # rows per file vary; the context size does not matter
        # per buffer: its shape, None on the position axis of the rows (a file's rows are its token count)
        self.shapes = {name: [None if rows and i == 2 else x for i, x in enumerate(b.shape)]
                       for name, b, rows in kv_template._buffers()}
        self.entries: dict[Path, _Entry] = {}
        self.lock = threading.Lock()
        for p in sorted(self.dir.glob("*.safetensors")):
            e = self._read_header(p)
            if e is not None:
                self.entries[p] = e

    def _read_header(self, p: Path) -> _Entry | None:
        from safetensors import safe_open

        try:
            _regular_file(p)
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
                shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
            if meta.get("format") != FORMAT:
                raise ValueError("not a pyllm prompt-cache file")
            if meta.get("model_sha256") != self.sha:
                raise ValueError("made for another model")
            if meta.get("layout") != self.layout:
                raise ValueError("made for another KV cache type")
            # the count, from the text, and the shapes are checked before the list is parsed: safetensors allows
            # a 100 MB header, whose 45 M tokens took 6.7 s and 540 MiB to parse, for each such file
            text = meta["tokens"]
            count = text.count(",") + 1 if isinstance(text, str) and text.strip("[] ") else 0
            if not count or count % PREFILL_CHUNK or count > MAX_CACHED_TOKENS:
                raise ValueError(f"bad token count {count}")
            # exact shapes for this token count: the file's size is what a save of these tokens writes, so a
            # header announcing gigabytes of rows is refused before anything is read or hashed
            for name, want in self.shapes.items():
                want = [count if x is None else x for x in want]
                if shapes.get(name) != want:
                    raise ValueError(f"tensor {name} has shape {shapes.get(name)}, expected {want}")
            tokens = tuple(int(t) for t in json.loads(text))
            if len(tokens) != count:
                raise ValueError("bad token list")
            if set(shapes) != set(self.shapes):
                raise ValueError(f"unexpected tensors {sorted(set(shapes) - set(self.shapes))[:3]}")
            if not isinstance(meta.get("sha256"), str):
                raise ValueError("no digest")
            st = p.stat()
            return _Entry(p, tokens, st.st_size, st.st_mtime)
        except Exception as e:  # any damage: the file is skipped, the server goes on
            log(f"ignoring {p}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return None

    def best(self, ids: list[int]) -> tuple[_Entry | None, int]:
        """The entry with the most reusable rows for ``ids`` and that count."""
        with self.lock:
            best, n = None, 0
            for e in self.entries.values():
                k = reusable(common_prefix(e.tokens, ids), len(ids), len(e.tokens))
                if k > n:
                    best, n = e, k
            return best, n

    def load_into(self, e: _Entry, slot: Slot, n: int) -> bool:
        """Rows 0..n-1 of entry ``e`` into ``slot``; False (logged, entry dropped) when the file is damaged."""
        from safetensors.torch import load_file

        kv = slot.kv
        try:
            _regular_file(e.path)  # it may have been replaced since the header was read
            from safetensors import safe_open

            with safe_open(str(e.path), framework="pt") as f:
                digest = (f.metadata() or {}).get("sha256")
            state = load_file(str(e.path))
            if tensors_sha256(state) != digest:
                raise ValueError("its bytes do not match its digest (damaged)")
            for name, t in state.items():
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise ValueError(f"tensor {name} holds NaN/Inf")
            kv.load_prefix_state(state, n)
        except Exception as ex:
            log(f"ignoring {e.path}: {type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''}")
            with self.lock:
                self.entries.pop(e.path, None)
            slot.tokens, slot.exact = [], 0
            return False
        slot.tokens, slot.exact = list(e.tokens[:n]), n
        e.used = time.time()
        try:
            os.utime(e.path)
        except OSError:
            pass
        return True

    def save(self, slot: Slot) -> None:
        """Keeps the slot's reusable rows unless a stored entry already covers them."""
        n = slot.exact - slot.exact % PREFILL_CHUNK
        if n < PREFILL_CHUNK:
            return
        tokens = tuple(slot.tokens[:n])
        with self.lock:
            if any(len(e.tokens) >= n and e.tokens[:n] == tokens for e in self.entries.values()):
                return
        from safetensors.torch import save_file

        kv = slot.kv
        t = kv.prefix_state(n)
        name = hashlib.sha256((self.sha + json.dumps(tokens)).encode()).hexdigest()[:40] + ".safetensors"
        path = self.dir / name
        try:  # a fresh name (mkstemp): a link planted at a fixed NAME.tmp would have redirected the write
            fd, tmp = private_tempfile(self.dir, f".{name}.", ".tmp")
            os.close(fd)
        except OSError as e:
            log(f"cannot write {path}: {e.strerror or e}")
            return
        meta = {"format": FORMAT, "model_sha256": self.sha, "layout": self.layout, "tokens": json.dumps(tokens),
                "sha256": tensors_sha256(t)}
        try:
            save_file(t, str(tmp), metadata=meta)
            os.replace(tmp, path)
        except Exception as e:  # a full disk is a SafetensorError, not an OSError: logged, the server goes on
            log(f"cannot write {path}: {type(e).__name__}: {e}")
            with contextlib.suppress(OSError):
                tmp.unlink()
            return
        with self.lock:
            # a shorter entry this one extends is now redundant
            for p, e in list(self.entries.items()):
                if tokens[:len(e.tokens)] == e.tokens:
                    self._delete(p)
            self.entries[path] = _Entry(path, tokens, path.stat().st_size, time.time())
            total = sum(e.size for e in self.entries.values())
            for e in sorted(self.entries.values(), key=lambda e: e.used):
                if total <= self.max_bytes:
                    break
                total -= e.size
                self._delete(e.path)

    def _delete(self, p: Path) -> None:
        self.entries.pop(p, None)
        try:
            p.unlink()
        except OSError:
            pass
