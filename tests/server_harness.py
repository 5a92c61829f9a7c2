"""`pyllm serve` in a subprocess on 127.0.0.1, and what the server tests share to drive it.

Each server runs `python -m pyllm.cli.main serve` on a free port and is driven by the official openai client (or
raw HTTP for what the client will not send). Every wait is bounded. The module-scoped server fixtures are in
conftest.py.
"""

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai  # the test extra installs it (pyproject.toml)
import pytest

ROOT = Path(__file__).resolve().parent.parent


KEY = "sk-test-key"


MAX_BODY = 65536


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``pyllm serve`` in a subprocess, ready once its banner names the port and /health answers there.

    A single server is started with --port 0 and the port read from its banner: a port picked here and bound by
    the server seconds later (a cold start on a busy machine) can be taken meanwhile by any other process, and
    /health could then answer from that process. Ray Serve's proxy cannot take port 0, so --replicas gets a
    free port picked here. Its output is read as it comes (``output()``), so a chatty server can never block on
    a full pipe."""

    def __init__(self, model: str, *args: str):
        ray = "--replicas" in args
        port = _free_port() if ray else 0
        # SIGTERM to exit: a single server takes a second; Ray's shutdown, replicas still loading on a busy 2-core
        # machine, took over 20 s
        self.grace = 120 if ray else 20
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pyllm.cli.main", "serve", model, "--port", str(port), "--threads", "1",
             *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._lines: list[str] = []
        self._clients: dict = {}
        self._banner = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            self._wait_ready(port, ray)
        except BaseException:  # Ctrl-C or a failed check while it starts: no caller will close it, so stop it here
            if self.proc.poll() is None:
                self.close()
            raise

    def _wait_ready(self, port: int, ray: bool):
        deadline = time.monotonic() + 600  # a first run may compile the extension
        if not ray:
            while not self._banner.wait(0.5):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self._fail("did not name its port")
            port = int(re.search(r" on http://127\.0\.0\.1:(\d+)/v1 ", "".join(self._lines)).group(1))
        self.port = port
        self.base = f"http://127.0.0.1:{self.port}"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._fail("exited")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self._fail("did not become healthy")

    def _read(self):
        for line in self.proc.stdout:  # ends when the process (and whatever inherited its stdout) does
            self._lines.append(line)
            if line.startswith("pyllm serve: ") and " on http://" in line:
                self._banner.set()

    def _fail(self, what: str):
        self.close()
        raise RuntimeError(f"pyllm serve {what} (exit {self.proc.returncode}): {self.output()}")

    def output(self) -> str:
        """Everything the server printed; once it has exited, all of it."""
        if self.proc.poll() is not None:
            self._reader.join(timeout=10)
        return "".join(self._lines)

    def client(self, key=KEY, **kw):
        """The official client for this server.  Without options, one per key, shared by the module's tests and
        their threads (it is thread-safe; making one loads the CA bundle, ~40 ms, and some tests make hundreds)."""
        if kw:
            return openai.OpenAI(base_url=self.base + "/v1", api_key=key, timeout=300, max_retries=0, **kw)
        if key not in self._clients:
            self._clients[key] = openai.OpenAI(base_url=self.base + "/v1", api_key=key, timeout=300, max_retries=0)
        return self._clients[key]

    def raw(self, path: str, body: bytes | None = None, key: str | None = KEY, method: str | None = None):
        """(status, parsed JSON or text) of one request made without the openai client."""
        req = urllib.request.Request(self.base + path, data=body, method=method or ("POST" if body else "GET"))
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                status, text = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        try:
            return status, json.loads(text)
        except json.JSONDecodeError:
            return status, text

    def metrics(self) -> dict[str, float]:
        _, text = self.raw("/metrics")
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+) ([-\d.e+]+)$", text, re.M)}

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=self.grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=20)


def _chat(text):
    return [{"role": "user", "content": text}]


def _ok(server):
    """The server still answers a normal request correctly."""
    r = server.client().chat.completions.create(model="smollm2", messages=_chat("Say hi."), max_tokens=4,
                                                temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens == 4


def check_echoed_prompt_logprobs(server, llm):
    """A served echo with logprobs scores the prompt as the library's LLM.logits does (OpenAI's legacy shape: the
    first token's logprob and top_logprobs null), with max_tokens 0 (scoring only) and with a completion."""
    import torch

    prompt = "The capital of France is Paris."
    ids = llm.tokenize(prompt)
    ref = torch.log_softmax(llm.logits(ids).double(), dim=-1)
    for n in (0, 3):
        r = server.client().completions.create(model="smollm2", prompt=prompt, echo=True, logprobs=1, max_tokens=n,
                                               temperature=0)
        lp = r.choices[0].logprobs
        assert r.choices[0].text.startswith(prompt) and len(lp.tokens) == len(ids) + n
        assert "".join(lp.tokens[:len(ids)]) == prompt and lp.text_offset[len(ids):len(ids) + 1] == [len(prompt)][:n]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(
            [float(ref[p - 1, ids[p]]) for p in range(1, len(ids))], abs=1e-3)


def _cors(server, path: str, origin: str, method: str = "OPTIONS", body: bytes | None = None, key: str | None = None):
    """(status, the response's Access-Control-* headers) of a browser's request from ``origin``: with OPTIONS, the
    preflight of a POST carrying Authorization and Content-Type."""
    req = urllib.request.Request(server.base + path, data=body, method=method, headers={"Origin": origin})
    if method == "OPTIONS":
        req.add_header("Access-Control-Request-Method", "POST")
        req.add_header("Access-Control-Request-Headers", "authorization, content-type, x-stainless-os")
    else:
        req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            status, headers = r.status, r.headers
    except urllib.error.HTTPError as e:
        status, headers = e.code, e.headers
    return status, {k.lower(): v for k, v in headers.items() if k.lower().startswith("access-control-")}


@contextlib.contextmanager
def served_in_thread(app):
    """``app`` (create_app's, over an LLM a test has patched: what a server subprocess would not let it reach)
    served by uvicorn in a thread of this process on a free port of 127.0.0.1; yields the base URL. On exit the
    server shuts down, which runs the app's lifespan end (its worker threads stop)."""
    import uvicorn

    from pyllm.server.app import listen_socket

    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, ws="none"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start within 60 s")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def failing_after(llm, n_tokens: int, error: Exception):
    """A stand-in for ``llm.generate_tokens`` that yields the real first ``n_tokens`` tokens, then raises ``error``:
    a generation that fails mid-way, as one over broken weights does at the step that first makes NaN."""
    real = llm.generate_tokens

    def generate_tokens(*args, **kwargs):
        for i, t in enumerate(real(*args, **kwargs)):
            if i == n_tokens:
                raise error
            yield t

    return generate_tokens
