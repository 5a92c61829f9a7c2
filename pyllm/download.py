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
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .errors import DownloadError, shorten

HF_REF = re.compile(r"^(?:https?://)?(?:hf\.co|huggingface\.co)/([A-Za-z0-9][\w.-]*)/([A-Za-z0-9][\w.-]*)"
                    r"(?::([\w.-]+))?/?$")
DEFAULT_QUANT = "Q4_K_M"
_SHA = re.compile(r'^(?:W/)?"?([0-9a-fA-F]{64})"?$')
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.I)
CHUNK = 1 << 20
MAX_REQUESTS = 64  # one pull never loops forever against a server that drops every connection
MAX_STALLS = 5  # consecutive requests that brought no new byte


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


def _open(url: str, headers: dict | None = None, timeout: float = 30.0):
    red = _Redirects()
    opener = urllib.request.build_opener(red)
    req = urllib.request.Request(url, headers={"User-Agent": _user_agent(), **(headers or {})})
    r = opener.open(req, timeout=timeout)
    return r, red.headers


def _http_error(what: str, e: Exception) -> DownloadError:
    if isinstance(e, urllib.error.HTTPError):
        return DownloadError(f"{what}: HTTP {e.code} {e.reason}")
    reason = getattr(e, "reason", None) or e
    return DownloadError(f"{what}: {reason}")


def _read_small(url: str, limit: int, timeout: float = 30.0) -> bytes:
    """GET a small document (an API listing, a .sha256 file), refusing one larger than ``limit`` bytes."""
    r, _ = _open(url, timeout=timeout)
    with r:
        data = r.read(limit + 1)
    if len(data) > limit:
        raise DownloadError(f"{url}: response larger than {limit} bytes")
    return data


def _sha_from_headers(headers_list) -> str | None:
    for h in headers_list:
        for key in ("X-Linked-Etag", "ETag"):
            m = _SHA.match((h.get(key) or "").strip())
            if m:
                return m.group(1).lower()
    return None


def _sidecar_sha(url: str, timeout: float) -> str | None:
    """The digest from ``URL.sha256`` (``sha256sum`` format or a bare hex digest), if the server has one."""
    try:
        text = _read_small(url + ".sha256", 4096, timeout).decode("ascii", "replace").strip()
    except (OSError, urllib.error.URLError, http.client.HTTPException, ValueError):
        return None  # none published (404), or not reachable: the digest is computed
    tok = text.split()[0] if text else ""
    if not re.fullmatch(r"[0-9a-fA-F]{64}", tok):  # published but unreadable: the check it promises cannot be made
        raise DownloadError(f"{shorten(url)}.sha256 is not a sha256 digest (64 hex digits, as sha256sum writes): "
                            f"{shorten(text, 80)!r}; give the right one with --sha256")
    return tok.lower()


def resolve_url(url: str, sha256: str | None = None, timeout: float = 30.0) -> Remote:
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
        s = _sidecar_sha(url, timeout)
        if s:
            r.sha256, r.sha_source = s, f"{url}.sha256"
    return r


def _quant_of(filename: str, quant: str) -> bool:
    # the quant as its own word: Q4_K matches "x-Q4_K.gguf", not "x-Q4_K_M.gguf"
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", filename, re.I) is not None


def resolve_hf(ref: str, timeout: float = 30.0) -> Remote:
    """hf.co/OWNER/REPO[:QUANT] -> the repository's GGUF file for QUANT (default Q4_K_M), its size and sha256."""
    m = HF_REF.match(ref)
    if not m:
        raise DownloadError(f"{shorten(ref)}: not of the form hf.co/OWNER/REPO[:QUANT]")
    owner, repo, quant = m.group(1), m.group(2), m.group(3)
    ep = hf_endpoint()
    api = f"{ep}/api/models/{owner}/{repo}?blobs=true"
    try:
        info = json.loads(_read_small(api, 64 << 20, timeout))
    except urllib.error.HTTPError as e:
        if e.code in (401, 403, 404):
            raise DownloadError(f"{ref}: no such repository at {ep}, or it is private or gated "
                                f"(HTTP {e.code})") from None
        raise _http_error(api, e) from None
    except (OSError, urllib.error.URLError, http.client.HTTPException) as e:
        raise _http_error(api, e) from None
    except ValueError as e:
        raise DownloadError(f"{api}: not a JSON model listing ({e})") from None
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


def fetch(remote: Remote, part: Path, progress: Progress | None = None, timeout: float = 30.0) -> tuple[str, int]:
    """Download ``remote`` into ``part``, resuming from the bytes ``part`` already holds; returns (sha256, size).

    The loop is bounded: at most MAX_REQUESTS requests, and at most MAX_STALLS in a row that bring no new byte.
    A server that announces more bytes than it sends is retried with a Range request from where it stopped; if it
    still cannot deliver them, the pull fails naming both numbers."""
    import hashlib

    h = hashlib.sha256()
    have = part.stat().st_size if part.exists() else 0
    if have:  # resuming: the digest must cover the bytes already on disk
        with open(part, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
    total = remote.size  # the full size, once anyone has said it
    stalls = 0
    if have and progress:
        progress.note(f"resuming at {have / 2**20:.1f} MiB" + (f" of {total / 2**20:.1f} MiB" if total else ""))
    for _ in range(MAX_REQUESTS):
        if total is not None and have > total:  # a previous, different file: start over
            part.unlink()
            return fetch(remote, part, progress, timeout)
        if total is not None and have == total and have > 0:
            break
        before = have
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            r, redirects = _open(remote.url, headers, timeout)
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
            else:  # 200: the whole file from byte 0 (a server without Range support restarts it)
                if have:
                    h = hashlib.sha256()
                    have = before = 0
                cl = r.headers.get("Content-Length")
                end = int(cl) if cl and cl.isdigit() else None
                if total is None:
                    total = end
            if progress and total is not None:  # a URL's size is known once its server answers: % and totals
                progress.total = total
            mode = "ab" if have else "wb"
            try:
                with open(part, mode) as f:
                    while chunk := r.read(CHUNK):
                        f.write(chunk)
                        h.update(chunk)
                        have += len(chunk)
                        if progress:
                            progress.update(have)
            except (OSError, http.client.HTTPException) as e:
                if isinstance(e, OSError) and not isinstance(e, (ConnectionError, socket.timeout, TimeoutError)):
                    raise DownloadError(f"{part}: {e}") from None  # a local write error: retrying cannot help
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
    if progress:
        progress.update(have)
    if total is not None and have != total:
        raise DownloadError(f"{remote.url}: the server announced {total} bytes but sent {have} (resuming with "
                            f"Range requests did not bring the rest)")
    return h.hexdigest(), have
