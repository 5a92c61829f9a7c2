"""Reading and writing files whose path someone else may have prepared.

Readers (config.json, tokenizer.json, safetensors shards, chat templates, conversation and history files) open
only regular files: a FIFO blocks ``open`` until a writer comes (the process hangs with no message) and a device
such as /dev/zero never ends. ``open_regular`` stats the path first and opens it non-blocking, then checks the
open descriptor again (the path may have been swapped in between). JSON is read through ``read_json``: a byte cap,
strict UTF-8 and a nesting bound checked before the recursive parser runs.

Writers of temporary and resume files (``.partial`` downloads, locks, records, conversion output) never follow a
symlink planted at their name: ``open_private`` removes whatever non-regular entry has the name (a link is
removed, not its target) and opens with ``O_NOFOLLOW``; ``atomic_write`` writes a fresh ``mkstemp`` file (a name
nobody can predict, created exclusively) and renames it over the target.

Every failure is a ``PyllmError`` (or the ``err`` class given) naming the file.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from pathlib import Path

from .errors import PyllmError, shorten

MAX_JSON_BYTES = 64 << 20
MAX_JSON_DEPTH = 64  # tokenizer.json nests about 8 levels; Python's parser recurses once per level


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words, for messages."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def check_regular(path, err: type[PyllmError] = PyllmError, shown: str | None = None) -> os.stat_result:
    """The stat of ``path`` (symlinks followed) when it is a regular file; ``err`` naming what it is otherwise.
    ``shown``: the name messages give the file (default: the path, up to 200 characters)."""
    shown = shown or shorten(path, 200)
    try:
        st = os.stat(path)
    except OSError as e:
        raise err(f"{shown}: cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise err(f"{shown}: is {kind_of(st.st_mode)}, not a regular file")
    return st


def open_regular(path, err: type[PyllmError] = PyllmError, shown: str | None = None):
    """``path`` open for binary reading, refused unless it is a regular file (checked before and after the open,
    which is non-blocking so that a FIFO swapped in between cannot hang it)."""
    shown = shown or shorten(path, 200)
    check_regular(path, err, shown)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise err(f"{shown}: cannot read: {e.strerror or e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise err(f"{shown}: is {kind_of(st.st_mode)}, not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_regular(path, limit: int, err: type[PyllmError] = PyllmError, shown: str | None = None) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes."""
    shown = shown or shorten(path, 200)
    with open_regular(path, err, shown) as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise err(f"{shown}: cannot read: {e.strerror or e}") from None
    if len(data) > limit:
        raise err(f"{shown}: larger than {_size(limit)}")
    return data


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"


def json_depth(raw: bytes, bound: int) -> int:
    """How deep brackets outside strings nest; any value above ``bound`` is only known to be above it."""
    if raw.count(b"[") + raw.count(b"{") <= bound:
        return 0  # cannot be deeper than that
    import numpy as np

    outside = re.sub(rb'"(?:[^"\\]|\\.)*"', b"", raw)  # strings may hold brackets
    brackets = np.frombuffer(re.sub(rb"[^\[\]{}]", b"", outside), dtype=np.uint8)
    deepest = depth = 0
    for i in range(0, len(brackets), 1 << 20):  # in slices: the running sums of 64 MiB would take 256 MiB
        b = brackets[i:i + (1 << 20)]
        run = depth + np.cumsum(np.where((b == ord("[")) | (b == ord("{")), 1, -1).astype(np.int32))
        deepest, depth = max(deepest, int(run.max())), int(run[-1])
    return deepest


def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH):
    """JSON from bytes: strict UTF-8, nesting at most ``max_depth`` (checked before parsing). ValueError (with
    the reason) otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 (byte {raw[e.start]:#04x} at offset {e.start})") from None
    if json_depth(raw, max_depth) > max_depth:
        raise ValueError(f"arrays or objects nest deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except RecursionError:  # not reached after the depth check; kept for a parser that recurses more per level
        raise ValueError("arrays or objects nest too deeply") from None


def read_json(path, err: type[PyllmError] = PyllmError, limit: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH,
              want: type | None = dict):
    """The JSON value in a regular file of at most ``limit`` bytes; ``want`` (default: an object) is its type."""
    raw = read_regular(path, limit, err)
    try:
        data = parse_json(raw, max_depth)
    except ValueError as e:  # JSONDecodeError is a ValueError
        raise err(f"{shorten(path, 200)}: cannot read JSON ({shorten(e, 160)})") from None
    if want is not None and not isinstance(data, want):
        raise err(f"{shorten(path, 200)}: is not a JSON {'object' if want is dict else want.__name__}")
    return data


# ---- writers -----------------------------------------------------------------------------------------------------


def open_private(path, append: bool = False, err: type[PyllmError] = PyllmError) -> int:
    """A descriptor for writing ``path``, a file only pyllm writes (a download's ``.partial``, a lock): whatever
    else is at that name (a symlink, a FIFO, a device) is removed first, and the open does not follow a link
    planted after that. ``append`` keeps the bytes already there (a resume); otherwise they are kept too (a lock)
    unless the caller truncates."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise err(f"{shorten(p, 200)}: is a directory; remove it")
        p.unlink()  # a link goes, not its target
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_APPEND if append else 0)
    try:
        fd = os.open(p, flags, 0o644)
    except OSError as e:
        raise err(f"{shorten(p, 200)}: cannot open for writing: {e.strerror or e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise err(f"{shorten(p, 200)}: is {kind_of(st.st_mode)}, not a regular file")
    os.set_blocking(fd, True)
    return fd


def private_tempfile(directory, prefix: str, suffix: str = "") -> tuple[int, Path]:
    """(descriptor, path) of a new file in ``directory`` with a name nobody could predict, created exclusively."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
    return fd, Path(name)


def atomic_write(path, data: bytes | str) -> None:
    """``path`` replaced by ``data`` all at once (a fresh temporary file renamed over it): a reader never sees half
    of it, and a symlink planted at a predictable temporary name cannot redirect the write. OSError as raised."""
    p = Path(path)
    fd, tmp = private_tempfile(p.parent, f".{p.name}.", ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
