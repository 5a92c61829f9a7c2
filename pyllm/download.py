"""HTTP(S) downloads into the model cache: ``pyllm pull URL`` and ``pyllm pull hf.co/OWNER/REPO[:QUANT]``.

A download goes to a hidden ``.NAME.partial`` file next to its final place and resumes from there with an HTTP
``Range`` request, both after a dropped connection (a bounded number of retries within one pull) and on the next
pull after an interrupted one. The expected sha256 comes from ``--sha256``, the Hugging Face API listing
(``lfs.sha256``), an ``X-Linked-Etag``/``ETag`` header holding a sha256 (what the HF hub sends), or a
``URL.sha256`` sidecar file; a download whose digest differs is deleted, never cached. A file with no published
digest is still checked to be a complete GGUF (its header and tensor table inside the file) before it is cached.

``hf.co/OWNER/REPO[:QUANT]`` is resolved the way Ollama and llama.cpp's ``-hf`` do: list the repository's files
(``{endpoint}/api/models/OWNER/REPO?blobs=true``), pick the single-file GGUF whose name carries QUANT (default
Q4_K_M) and download ``{endpoint}/OWNER/REPO/resolve/main/FILE``. The endpoint is ``$PYLLM_HF_ENDPOINT``, else
``$HF_ENDPOINT`` (huggingface_hub's variable), else https://huggingface.co.

A server cannot hang a pull or fill the disk (``Limits``): the response head (status line and headers, redirects
included) must arrive within ``head_timeout`` seconds; a body slower than ``speed_limit`` bytes/s over
``speed_time`` seconds is aborted, as curl's ``--speed-limit``/``--speed-time`` do; the download is capped at the
size the source declares (listing, ``Content-Length``, ``Content-Range``), or, when it declares none, at the size
the GGUF header and tensor table give, read from the first bytes; a size larger than the free disk is refused
before it is fetched; the first four bytes must be the GGUF magic. Listings and ``.sha256`` files are read with a
small cap and parsed with a nesting bound. The ``.partial`` file is opened without following a planted symlink.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import shutil
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .errors import DownloadError, GGUFError, shorten
from .formats.gguf import GGUF_MAGIC, NeedMoreBytes, expected_file_size
from .safe_io import open_private, open_regular, parse_json

HF_REF = re.compile(r"^(?:https?://)?(?:hf\.co|huggingface\.co)/([A-Za-z0-9][\w.-]*)/([A-Za-z0-9][\w.-]*)"
                    r"(?::([\w.-]+))?/?$")
DEFAULT_QUANT = "Q4_K_M"
_SHA = re.compile(r'^(?:W/)?"?([0-9a-fA-F]{64})"?$')
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.I)
CHUNK = 1 << 20
MAX_REQUESTS = 64  # one pull never loops forever against a server that drops every connection
MAX_STALLS = 5  # consecutive requests that brought no new byte


@dataclass
class Limits:
    """What a download tolerates from a server before it gives up (see the module docstring)."""
    head_timeout: float = 30.0  # seconds for the response head, redirects included
    speed_limit: int = 1024  # bytes/s, averaged over ...
    speed_time: float = 30.0  # ... this many seconds; slower is aborted (also: no byte at all for this long)
    max_header: int = 256 << 20  # a GGUF header and tensor table larger than this is no model pyllm can load
    listing_bytes: int = 8 << 20  # an API listing (the hub's is a few hundred KB for thousands of files)


LIMITS = Limits()


def is_remote(ref: str) -> bool:
    """A URL or an hf.co reference (as opposed to a registry name or a local path)."""
    return ref.startswith(("http://", "https://")) or bool(HF_REF.match(ref))


def hf_endpoint() -> str:
    ep = os.environ.get("PYLLM_HF_ENDPOINT") or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    return ep.rstrip("/")


def _user_agent() -> str:
    from ._version import __version__

    return f"pyllm/{__version__}"


class Progress:
    """One progress line for a whole download, redrawn in place on a terminal and driven by byte counts.

    Silent when the stream is not a terminal (logs and pipes get only the final summary line)."""

    def __init__(self, label: str, total: int | None, stream=None, enabled: bool | None = None):
        self.stream = stream or sys.stderr
        self.enabled = (hasattr(self.stream, "isatty") and self.stream.isatty()) if enabled is None else enabled
        self.silent = enabled is False  # quiet: not even the one-off notes a log keeps (note())
        self.label, self.total, self.done = label, total, 0
        self.t0 = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def update(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and done != self.total):
            return
        self._last = now
        rate = done / max(now - self.t0, 1e-6) / 2**20
        if self.total:
            frac = min(done / self.total, 1.0)
            bar = "#" * int(frac * 24)
            line = (f"pulling {self.label}  [{bar:<24}] {frac * 100:3.0f}%  {done / 2**20:.1f}/"
                    f"{self.total / 2**20:.1f} MiB  {rate:.1f} MiB/s")
        else:
            line = f"pulling {self.label}  {done / 2**20:.1f} MiB  {rate:.1f} MiB/s"
        self.stream.write("\r" + line + "\033[K")
        self.stream.flush()
        self._drawn = True

    def note(self, text: str) -> None:
        """A line a log keeps too (resuming at N MiB), above the redrawn progress line."""
        if self.silent:
            return
        self.stream.write(("\r\033[K" if self._drawn else "") + f"pulling {self.label}: {text}\n")
        self.stream.flush()
        self._drawn = False

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False


@dataclass
class Remote:
    """A file to download: where from, where to in the cache, and what is known about it beforehand."""
    ref: str  # what the user typed (hf.co/... or the URL)
    url: str
    filename: str  # local name (sanitized)
    subdir: tuple[str, ...]  # under the cache's models/ directory
    size: int | None = None
    sha256: str | None = None
    sha_source: str | None = None  # where the expected digest came from, for error messages


def safe_name(name: str) -> str:
    """A file or directory name that cannot climb out of the cache (no separators, no leading dot)."""
    s = re.sub(r"[^A-Za-z0-9._+-]", "_", name).lstrip(".")
    return s[:200] or "model.gguf"


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Keeps the headers of each redirect response: the HF hub puts X-Linked-Etag (the file's sha256) on the
    redirect to its CDN, not on the final response."""

    def __init__(self):
        self.headers: list = []

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.headers.append(headers)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _TrackedHTTP(urllib.request.HTTPHandler):
    """Keeps the socket of every connection it opens, so that the head deadline can cut them."""

    def __init__(self, socks: list):
        super().__init__()
        self.socks = socks

    def http_open(self, req):
        socks = self.socks

        class Conn(http.client.HTTPConnection):
            def connect(self):
                super().connect()
                socks.append(self.sock)

        return self.do_open(Conn, req)


class _TrackedHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, socks: list):
        super().__init__()
        self.socks = socks

    def https_open(self, req):
        socks = self.socks

        class Conn(http.client.HTTPSConnection):
            def connect(self):
                super().connect()
                socks.append(self.sock)

        kw = {"context": self._context}
        if hasattr(self, "_check_hostname"):  # Python < 3.12
            kw["check_hostname"] = self._check_hostname
        return self.do_open(Conn, req, **kw)


def _open(url: str, headers: dict | None = None, limits: Limits | None = None):
    """(response, headers of the redirects on the way). The socket timeout bounds each wait for a byte; a timer
    bounds the whole head, which a server could otherwise drip a byte at a time (up to 100 header lines of 64 KiB
    each, without end across redirects)."""
    limits = limits or LIMITS
    red = _Redirects()
    socks: list = []
    opener = urllib.request.build_opener(red, _TrackedHTTP(socks), _TrackedHTTPS(socks))
    req = urllib.request.Request(url, headers={"User-Agent": _user_agent(), **(headers or {})})
    expired = threading.Event()

    def cut():
        expired.set()
        for sock in list(socks):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(limits.head_timeout, cut)
    timer.daemon = True
    timer.start()
    try:
        r = opener.open(req, timeout=min(limits.head_timeout, limits.speed_time))
    except Exception:
        if expired.is_set():
            raise DownloadError(f"{shorten(url)}: no complete response head within {limits.head_timeout:g} s") \
                from None
        raise
    finally:
        timer.cancel()
    if expired.is_set():
        r.close()
        raise DownloadError(f"{shorten(url)}: no complete response head within {limits.head_timeout:g} s")
    return r, red.headers


def _chunks(r, url: str, limits: Limits):
    """The body's bytes as they arrive (``read1``: whatever came, not a full 1 MiB), aborted with a DownloadError
    when fewer than ``speed_limit`` bytes/s arrive over ``speed_time`` seconds."""
    start, got = time.monotonic(), 0
    while True:
        try:
            chunk = r.read1(CHUNK)
        except (socket.timeout, TimeoutError):
            raise DownloadError(f"{shorten(url)}: no data for {limits.speed_time:g} s; the transfer was "
                                f"aborted") from None
        if not chunk:
            return
        got += len(chunk)
        yield chunk
        now = time.monotonic()
        if now - start >= limits.speed_time:
            if got < limits.speed_limit * (now - start):
                raise DownloadError(f"{shorten(url)}: {got} bytes in {now - start:.0f} s, under the floor of "
                                    f"{limits.speed_limit} bytes/s; the transfer was aborted")
            start, got = now, 0


def _http_error(what: str, e: Exception) -> DownloadError:
    if isinstance(e, DownloadError):
        return e
    if isinstance(e, urllib.error.HTTPError):
        return DownloadError(f"{shorten(what, 200)}: HTTP {e.code} {shorten(e.reason, 100)}")
    reason = getattr(e, "reason", None) or e
    return DownloadError(f"{shorten(what, 200)}: {shorten(reason, 200)}")


def _read_small(url: str, limit: int, limits: Limits | None = None) -> bytes:
    """GET a small document (an API listing, a .sha256 file), refusing one larger than ``limit`` bytes, under the
    same head deadline and speed floor as a download."""
    limits = limits or LIMITS
    r, _ = _open(url, limits=limits)
    data = bytearray()
    with r:
        cl = r.headers.get("Content-Length")
        if cl and cl.isdigit() and int(cl) > limit:
            raise DownloadError(f"{shorten(url, 200)}: response of {cl} bytes, larger than {limit} bytes")
        for chunk in _chunks(r, url, limits):
            data += chunk
            if len(data) > limit:
                raise DownloadError(f"{shorten(url, 200)}: response larger than {limit} bytes")
    return bytes(data)


def _sha_from_headers(headers_list) -> str | None:
    for h in headers_list:
        for key in ("X-Linked-Etag", "ETag"):
            m = _SHA.match((h.get(key) or "").strip())
            if m:
                return m.group(1).lower()
    return None


def _sidecar_sha(url: str) -> str | None:
    """The digest from ``URL.sha256`` (``sha256sum`` format or a bare hex digest), if the server has one."""
    try:
        text = _read_small(url + ".sha256", 4096).decode("ascii", "replace").strip()
    except (DownloadError, OSError, urllib.error.URLError, http.client.HTTPException, ValueError):
        return None
    tok = text.split()[0] if text else ""
    if not re.fullmatch(r"[0-9a-fA-F]{64}", tok):  # published but unreadable: the check it promises cannot be made
        raise DownloadError(f"{shorten(url)}.sha256 is not a sha256 digest (64 hex digits, as sha256sum writes): "
                            f"{shorten(text, 80)!r}; give the right one with --sha256")
    return tok.lower()


def resolve_url(url: str, sha256: str | None = None) -> Remote:
    p = urllib.parse.urlsplit(url)
    if p.scheme not in ("http", "https") or not p.hostname:
        raise DownloadError(f"{shorten(url)}: not an http(s) URL")
    try:
        p.hostname.encode("idna")  # what the socket layer does: a label over 63 characters raises UnicodeError there
    except UnicodeError:
        raise DownloadError(f"{shorten(url)}: {shorten(p.hostname)} is not a valid host name") from None
    name = safe_name(urllib.parse.unquote(p.path.rsplit("/", 1)[-1]) or "model.gguf")
    host = safe_name(p.hostname + (f"_{p.port}" if p.port else ""))
    r = Remote(ref=url, url=url, filename=name, subdir=("url", host))
    if sha256:
        r.sha256, r.sha_source = sha256.lower(), "--sha256"
    else:
        s = _sidecar_sha(url)
        if s:
            r.sha256, r.sha_source = s, f"{url}.sha256"
    return r


def _quant_of(filename: str, quant: str) -> bool:
    # the quant as its own word: Q4_K matches "x-Q4_K.gguf", not "x-Q4_K_M.gguf"
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", filename, re.I) is not None


def resolve_hf(ref: str) -> Remote:
    """hf.co/OWNER/REPO[:QUANT] -> the repository's GGUF file for QUANT (default Q4_K_M), its size and sha256."""
    m = HF_REF.match(ref)
    if not m:
        raise DownloadError(f"{shorten(ref)}: not of the form hf.co/OWNER/REPO[:QUANT]")
    owner, repo, quant = m.group(1), m.group(2), m.group(3)
    ep = hf_endpoint()
    api = f"{ep}/api/models/{owner}/{repo}?blobs=true"
    try:
        info = parse_json(_read_small(api, LIMITS.listing_bytes), max_depth=32)
    except urllib.error.HTTPError as e:
        if e.code in (401, 403, 404):
            raise DownloadError(f"{ref}: no such repository at {ep}, or it is private or gated "
                                f"(HTTP {e.code})") from None
        raise _http_error(api, e) from None
    except (OSError, urllib.error.URLError, http.client.HTTPException) as e:
        raise _http_error(api, e) from None
    except ValueError as e:
        raise DownloadError(f"{shorten(api, 200)}: not a JSON model listing ({shorten(e, 160)})") from None
    sib = info.get("siblings") if isinstance(info, dict) else None
    if not isinstance(sib, list):
        raise DownloadError(f"{api}: the listing has no 'siblings' list of files")
    files = [s for s in sib if isinstance(s, dict) and isinstance(s.get("rfilename"), str)
             and s["rfilename"].lower().endswith(".gguf") and "mmproj" not in s["rfilename"].lower()]
    if not files:
        raise DownloadError(f"{ref}: the repository has no .gguf file")
    want = quant or DEFAULT_QUANT
    hits = [s for s in files if _quant_of(s["rfilename"].rsplit("/", 1)[-1], want)]
    if not hits and quant is None and len(files) == 1:
        hits = files  # one GGUF in the repository: that one, whatever its type
    single = [s for s in hits if not _SPLIT.search(s["rfilename"])]
    if not single:
        names = sorted(s["rfilename"] for s in files)
        why = (f"only as split files ({hits[0]['rfilename']}, ...), which pyllm cannot load" if hits
               else f"no file for {want}")
        raise DownloadError(f"{ref}: {why}; files: {', '.join(names[:12])}{' ...' if len(names) > 12 else ''}")
    s = sorted(single, key=lambda s: (s["rfilename"].count("/"), s["rfilename"]))[0]
    lfs = s.get("lfs") if isinstance(s.get("lfs"), dict) else {}
    size = lfs.get("size", s.get("size"))
    sha = lfs.get("sha256")
    path = urllib.parse.quote(s["rfilename"])
    return Remote(ref=ref, url=f"{ep}/{owner}/{repo}/resolve/main/{path}",
                  filename=safe_name(s["rfilename"].rsplit("/", 1)[-1]),
                  subdir=("hf.co", safe_name(owner), safe_name(repo)),
                  size=size if isinstance(size, int) and size >= 0 else None,
                  sha256=sha.lower() if isinstance(sha, str) and re.fullmatch(r"[0-9a-fA-F]{64}", sha) else None,
                  sha_source="the Hugging Face listing")


def _content_range(value: str | None) -> tuple[int, int, int | None]:
    """'bytes 100-199/1000' -> (100, 200, 1000): start, end (exclusive), total (None when the server writes '*')."""
    m = re.match(r"bytes\s+(\d+)-(\d+)/(\d+|\*)", value or "")
    if not m:
        raise DownloadError(f"the server answered a range request with Content-Range {value!r}")
    return int(m.group(1)), int(m.group(2)) + 1, (None if m.group(3) == "*" else int(m.group(3)))


class _BadBytes(DownloadError):
    """The bytes received cannot be part of the file (not a GGUF, more than its size): they are deleted."""


class _Sink:
    """Where the body's bytes go: the ``.partial`` file (opened without following a planted symlink), the digest,
    and the checks made as they arrive: the GGUF magic in the first four bytes, the size cap (declared, else from
    the GGUF header read from the first bytes) and the free disk."""

    def __init__(self, remote: Remote, part: Path, limits: Limits):
        import hashlib

        self.remote, self.part, self.limits = remote, part, limits
        self.url = shorten(remote.url, 200)
        self.fd = open_private(part, append=True, err=DownloadError)
        self.have = os.fstat(self.fd).st_size
        self.h = hashlib.sha256()
        self.head = bytearray()  # the file's first bytes, kept until the cap is known
        self.cap: int | None = None  # the most bytes the file may have
        self.cap_from = ""
        self.next_parse = 1 << 16  # the header is parsed once this much has come, then at each doubling
        if self.have:  # resuming: the digest must cover the bytes already on disk
            with open_regular(part, DownloadError) as f:
                while block := f.read(1 << 22):
                    self.h.update(block)
                    if len(self.head) < limits.max_header:
                        self.head += block[:limits.max_header - len(self.head)]
            self.next_parse = 0
            self._check_head()

    def close(self) -> None:
        os.close(self.fd)

    def restart(self) -> None:
        """The server sends the whole file again (no Range support): forget what was there."""
        import hashlib

        os.ftruncate(self.fd, 0)
        self.have, self.h, self.head = 0, hashlib.sha256(), bytearray()
        if self.cap_from == "the GGUF header":
            self.cap, self.cap_from = None, ""

    def declare(self, total: int | None, source: str) -> None:
        """The source says the file has ``total`` bytes: that is the cap; refused if the disk cannot hold it."""
        if total is None or (self.cap is not None and self.cap_from != "the GGUF header"):
            return
        self.cap, self.cap_from = total, source
        self._check_room()

    def _check_room(self) -> None:
        left = self.cap - self.have
        free = shutil.disk_usage(self.part.parent).free
        if left > free:
            raise DownloadError(f"{self.url}: {self.cap_from} says the file has {self.cap} bytes; {left} more do not "
                                f"fit the {free} bytes free in {self.part.parent}")

    def _check_head(self) -> None:
        head = bytes(self.head[:4])
        if head != GGUF_MAGIC[:len(head)]:
            raise _BadBytes(f"{self.url}: not a GGUF file: it starts with {head!r}, expected {GGUF_MAGIC!r}")
        if self.cap is not None or len(self.head) < self.next_parse:
            return
        try:
            size = expected_file_size(bytes(self.head), self.url)
        except NeedMoreBytes:
            if len(self.head) >= self.limits.max_header:
                raise _BadBytes(f"{self.url}: the GGUF header and tensor table are not complete within "
                                    f"{self.limits.max_header} bytes") from None
            self.next_parse = 2 * len(self.head)  # parsed again when twice as much has come: linear in all
            return
        except GGUFError as e:
            raise _BadBytes(str(e)) from None
        self.cap, self.cap_from = size, "the GGUF header"
        self._check_room()
        if self.have > self.cap:
            raise _BadBytes(f"{self.url}: the server sent more than the {self.cap} bytes {self.cap_from} "
                                f"gives; the transfer was aborted")

    def write(self, chunk: bytes) -> None:
        contiguous = len(self.head) == self.have  # the head holds every byte so far: this chunk extends it
        if contiguous and len(self.head) < self.limits.max_header:
            self.head += chunk[:self.limits.max_header - len(self.head)]
        if contiguous and (self.have < 4 or self.cap is None):
            self._check_head()  # before the bytes are written: a wrong magic leaves nothing on disk
        if self.cap is not None and self.have + len(chunk) > self.cap:
            raise _BadBytes(f"{self.url}: the server sent more than the {self.cap} bytes {self.cap_from} "
                            f"gives; the transfer was aborted")
        _write_all(self.fd, chunk)
        self.h.update(chunk)
        self.have += len(chunk)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def fetch(remote: Remote, part: Path, progress: Progress | None = None, limits: Limits | None = None) \
        -> tuple[str, int]:
    """Download ``remote`` into ``part``, resuming from the bytes ``part`` already holds; returns (sha256, size).

    The loop is bounded: at most MAX_REQUESTS requests, and at most MAX_STALLS in a row that bring no new byte;
    each request under ``limits`` (head deadline, speed floor, size cap). A server that announces more bytes than
    it sends is retried with a Range request from where it stopped; if it still cannot deliver them, the pull fails
    naming both numbers."""
    limits = limits or LIMITS
    sink = None
    try:
        sink = _Sink(remote, part, limits)
        return _fetch(remote, sink, progress, limits)
    except _BadBytes as e:
        _drop(part)
        raise DownloadError(f"{e}; the bytes received were deleted") from None
    finally:
        if sink is not None:
            sink.close()
            if sink.have == 0:
                _drop(part)


def _drop(part: Path) -> None:
    """Removes the ``.partial`` file (a link planted there goes, never its target)."""
    with contextlib.suppress(FileNotFoundError):
        part.unlink()


def _fetch(remote: Remote, sink: _Sink, progress: Progress | None, limits: Limits) -> tuple[str, int]:
    total = remote.size  # the full size, once anyone has said it
    sink.declare(total, "the listing")
    stalls = 0
    if sink.have and progress:
        progress.note(f"resuming at {sink.have / 2**20:.1f} MiB" + (f" of {total / 2**20:.1f} MiB" if total else ""))
    for _ in range(MAX_REQUESTS):
        if total is not None and sink.have > total:  # a previous, different file: start over
            sink.restart()
            continue
        if total is not None and sink.have == total and sink.have > 0:
            break
        have = before = sink.have
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            r, redirects = _open(remote.url, headers, limits)
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:  # nothing after `have`: the server's file ends here
                m = re.match(r"bytes\s+\*/(\d+)", e.headers.get("Content-Range") or "")
                srv_total = int(m.group(1)) if m else None
                if total is not None and have != total:
                    raise DownloadError(f"{remote.url}: the server announced {total} bytes but has only "
                                        f"{srv_total if srv_total is not None else have}") from None
                total = have
                break
            raise _http_error(remote.url, e) from None
        except (OSError, urllib.error.URLError, http.client.HTTPException) as e:
            stalls += 1
            if stalls >= MAX_STALLS:
                raise _http_error(remote.url, e) from None
            time.sleep(min(0.2 * stalls, 1.0))
            continue
        with r:
            if remote.sha256 is None:
                s = _sha_from_headers([*redirects, r.headers])
                if s:
                    remote.sha256, remote.sha_source = s, "the server's ETag"
            if have and r.status == 206:
                start, end, srv_total = _content_range(r.headers.get("Content-Range"))
                if start != have:
                    raise DownloadError(f"{remote.url}: asked for bytes from {have}, the server sent from {start}")
                if srv_total is not None:
                    total = total if total is not None else srv_total
                    if srv_total != total:
                        raise DownloadError(f"{remote.url}: the file's size changed during the download "
                                            f"({total} -> {srv_total} bytes)")
                    sink.declare(total, "the server's Content-Range")
            else:  # 200: the whole file from byte 0 (a server without Range support restarts it)
                if have:
                    sink.restart()
                    have = before = 0
                cl = r.headers.get("Content-Length")
                end = int(cl) if cl and cl.isdigit() else None
                if total is None:
                    total = end
                    sink.declare(total, "the server's Content-Length")
            if progress and total is not None:  # a URL's size is known once its server answers: % and totals
                progress.total = total
            try:
                for chunk in _chunks(r, remote.url, limits):
                    sink.write(chunk)
                    if progress:
                        progress.update(sink.have)
            except (OSError, http.client.HTTPException) as e:
                if isinstance(e, OSError) and not isinstance(e, (ConnectionError, socket.timeout, TimeoutError)):
                    raise DownloadError(f"{sink.part}: {e}") from None  # a local write error: retrying cannot help
        have = sink.have
        if end is None and total is None:
            total = have  # no length announced: the end of the body is the end of the file
            break
        want = end if end is not None else total
        if have >= want and (total is None or have >= total):
            total = have if total is None else total
            break
        stalls = 0 if have > before else stalls + 1  # dropped mid-body: resume from `have`
        if stalls >= MAX_STALLS:
            break
        time.sleep(min(0.1 * (stalls + 1), 1.0))
    have = sink.have
    if progress:
        progress.update(have)
    if total is not None and have != total:
        raise DownloadError(f"{remote.url}: the server announced {total} bytes but sent {have} (resuming with "
                            f"Range requests did not bring the rest)")
    return sink.h.hexdigest(), have
