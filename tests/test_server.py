"""`pyllm serve` driven by the official openai client over 127.0.0.1.

Each server runs `python -m pyllm.cli.main serve` in a subprocess on a free port. The references: the library's
own greedy generation (the server must return the same text), OpenAI's documented stream and error shapes.
Every wait is bounded.
"""

import concurrent.futures
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

from conftest import fixture_path, pyllm_model

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
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, timeout=300, max_retries=0, **kw)

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


@pytest.fixture(scope="module")
def smol():
    s = Server(fixture_path("smollm2"), "--alias", "smollm2", "--ctx", "512", "--api-key", KEY,
               "--max-body", str(MAX_BODY))
    yield s
    s.close()


@pytest.fixture(scope="module")
def smol_llm():
    # The session's shared LLM, with whatever conversation an earlier module (test_api) left in its cache: a chat
    # reusing that cached prefix differs from a fresh prefill by up to ~0.5 in the logits (docs/DESIGN.md,
    # Server) and so in its greedy text, while this module's server starts empty.
    llm = pyllm_model("smollm2", n_ctx=512, n_threads=1)
    llm.reset()
    return llm


def _chat(text):
    return [{"role": "user", "content": text}]


def _ok(server):
    """The server still answers a normal request correctly."""
    r = server.client().chat.completions.create(model="smollm2", messages=_chat("Say hi."), max_tokens=4,
                                                temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens == 4


def test_models_and_health(smol):
    ids = [m.id for m in smol.client().models.list().data]
    assert ids == ["smollm2"]
    m = smol.client().models.retrieve("smollm2")  # GET /v1/models/{model}, as OpenAI's API serves it
    assert m.id == "smollm2" and m.object == "model" and m.owned_by == "pyllm"
    with pytest.raises(openai.NotFoundError) as e:
        smol.client().models.retrieve("gpt-9/x")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert smol.raw("/health", key=None) == (200, {"status": "ok"})


def test_chat_matches_library_and_stream_matches_chat(smol, smol_llm):
    msgs = _chat("Name three colors.")
    want = smol_llm.chat(msgs, max_tokens=24, temperature=0)
    c = smol.client()
    r = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(smol_llm.chat_ids(msgs))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [r.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stream_ends_with_done_and_no_usage_unless_asked(smol):
    req = json.dumps({"model": "smollm2", "messages": _chat("Hi"), "max_tokens": 3, "temperature": 0,
                      "stream": True}).encode()
    status, text = smol.raw("/v1/chat/completions", req)
    assert status == 200
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["choices"] for c in chunks)  # no usage chunk without stream_options.include_usage
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_system_fingerprint_names_the_model_and_runtime(smol, smol_llm, qwen):
    client = smol.client()
    fps = [client.chat.completions.create(model="smollm2", messages=_chat("Hi"), max_tokens=2,
                                          temperature=0).system_fingerprint,
           client.completions.create(model="smollm2", prompt="Hi", max_tokens=2, temperature=0).system_fingerprint]
    fps += [c.system_fingerprint for c in client.chat.completions.create(
        model="smollm2", messages=_chat("Hi"), max_tokens=2, stream=True, stream_options={"include_usage": True})]
    fps += [c.system_fingerprint for c in client.completions.create(model="smollm2", prompt="Hi", max_tokens=2,
                                                                    stream=True)]
    # one value for every response and chunk, the library's for the same file and settings
    assert set(fps) == {smol_llm.system_fingerprint} and re.fullmatch(r"fp_[0-9a-f]{12}", fps[0])
    other = qwen.client().chat.completions.create(model="qwen", messages=_chat("Hi"), max_tokens=1, temperature=0)
    assert other.system_fingerprint.startswith("fp_") and other.system_fingerprint != fps[0]


def test_completion_matches_library_with_stop_and_logprobs(smol, smol_llm):
    prompt = "The capital of France is"
    want = smol_llm.generate(prompt, max_tokens=12, temperature=0, stop=["\n"])
    c = smol.client()
    r = c.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0, stop=["\n"], logprobs=3)
    ch = r.choices[0]
    assert ch.text == want and "\n" not in ch.text
    lp = ch.logprobs
    assert "".join(lp.tokens).startswith(ch.text)
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(v, abs=1e-6)  # greedy: the chosen token is the most likely
    streamed = "".join(x.choices[0].text for x in c.completions.create(
        model="smollm2", prompt=prompt, max_tokens=12, temperature=0, stop=["\n"], stream=True))
    assert streamed == want



def test_a_batch_of_one_token_prompt_is_that_prompt(smol, smol_llm):
    """OpenAI's prompt may be a batch: a list of strings or of token-id lists. A batch of one string was served as
    that string, a batch of one token-id list was a 400; both are the one prompt they hold. A batch of several
    stays a 400 naming the prompt (one prompt per request)."""
    c = smol.client()
    ids = smol_llm.tokenize("The capital of France is")
    want = c.completions.create(model="smollm2", prompt=ids, max_tokens=3, temperature=0)
    got = c.completions.create(model="smollm2", prompt=[ids], max_tokens=3, temperature=0)
    assert got.choices[0].text == want.choices[0].text and got.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="smollm2", prompt=[ids, ids], max_tokens=1)
    assert e.value.body["param"] == "prompt"

def test_sampling_parameters(smol, smol_llm):
    c = smol.client()
    msgs = _chat("Write a word.")
    kw = dict(model="smollm2", messages=msgs, max_tokens=8)
    # The seed replays the draws. Both requests find the same prompt in the KV cache: a fresh prefill and the
    # one-token step over a cached prefix give logits that differ by up to ~0.5 (the step's int8 activations),
    # enough to move a draw, so the cache state is part of what a seed replays.
    c.chat.completions.create(temperature=0, **kw)
    a = c.chat.completions.create(temperature=1.0, seed=7, **kw).choices[0].message.content
    b = c.chat.completions.create(temperature=1.0, seed=7, **kw).choices[0].message.content
    assert a == b
    # logit_bias -100 on the greedy first token (reference: the library's logits) makes it another token
    greedy = int(smol_llm.logits(smol_llm.chat_ids(msgs))[-1].argmax())
    want = smol_llm.tokenizer.token_bytes(greedy)
    for bias, same in (({}, True), ({str(greedy): -100}, False)):
        r = c.chat.completions.create(temperature=0, logprobs=True, top_logprobs=2, logit_bias=bias, **kw)
        first = r.choices[0].logprobs.content[0]
        assert (bytes(first.bytes) == want) == same
        assert len(first.top_logprobs) == 2 and first.logprob <= 0
    # pyllm's extras, as llama-server accepts them
    status, r = smol.raw("/v1/chat/completions", json.dumps({**kw, "temperature": 0.5, "top_k": 5, "min_p": 0.1,
                                                             "repeat_penalty": 1.1, "presence_penalty": 0.5,
                                                             "frequency_penalty": 0.5, "seed": 1}).encode())
    assert status == 200 and r["usage"]["completion_tokens"] >= 1



def test_null_sampler_settings_are_their_defaults(smol):
    """OpenAI's API documents temperature, top_p and the penalties as "number or null", and the official client
    sends null for a setting passed as None (as wrappers do for one left unset); null was a 400 "temperature must be
    a number". Reference: the same seeded request without them (after a warm-up: the seed replays the draws over
    the same cache state, see test_sampling_parameters)."""
    c = smol.client()
    kw = dict(model="smollm2", messages=_chat("Write a word."), max_tokens=6, seed=11)
    nulls = dict(temperature=None, top_p=None, presence_penalty=None, frequency_penalty=None)
    c.chat.completions.create(**kw)
    want = c.chat.completions.create(**kw).choices[0].message.content
    assert c.chat.completions.create(**kw, **nulls).choices[0].message.content == want
    r = c.completions.create(model="smollm2", prompt="Hi", max_tokens=2, **nulls, extra_body={"top_k": None,
                                                                                                 "min_p": None})
    assert r.usage.completion_tokens == 2

def test_errors_are_openai_objects_and_the_server_keeps_serving(smol):
    c = smol.client()
    # 400: malformed JSON
    status, body = smol.raw("/v1/chat/completions", b'{"model": "smollm2", "messages": [')
    assert status == 400 and "malformed JSON" in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    _ok(smol)
    # 404: unknown model, unknown route
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-9", messages=_chat("hi"), max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    status, body = smol.raw("/v1/nothing", b"{}")
    assert status == 404 and "unknown route" in body["error"]["message"]
    _ok(smol)
    # 400: negative max_tokens, a bad sampler value
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="smollm2", prompt="hi", max_tokens=-5)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="smollm2", messages=_chat("hi"), max_tokens=2, temperature=-1)
    _ok(smol)
    # 400: a prompt longer than the context (512)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="smollm2", prompt="word " * 700, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"
    _ok(smol)
    # 413: a body over the limit
    status, body = smol.raw("/v1/completions", json.dumps({"model": "smollm2", "prompt": "a" * MAX_BODY}).encode())
    assert status == 413 and "limit" in body["error"]["message"]
    _ok(smol)
    # 401: wrong and missing key (health stays open)
    with pytest.raises(openai.AuthenticationError):
        smol.client(key="sk-wrong").chat.completions.create(model="smollm2", messages=_chat("hi"), max_tokens=2)
    status, body = smol.raw("/v1/models", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    _ok(smol)
    m = smol.metrics()
    assert m["pyllm_queue_depth"] == 0


def test_prompts_that_cannot_fit_are_refused_before_they_are_tokenized(smol):
    """A 4 MB completion prompt held the worker ~15 s while it was tokenized, only to be refused for its length.
    Reference: OpenAI's context_length_exceeded, naming the parameter; "at least" is the wording of the bound
    that decides without tokenizing (the count after tokenizing says "has N tokens")."""
    big = "word " * 12_000  # under the test server's --max-body
    with pytest.raises(openai.BadRequestError) as e:
        smol.client().completions.create(model="smollm2", prompt=big, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    assert "at least" in e.value.body["message"] and "512" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        smol.client().chat.completions.create(model="smollm2", messages=_chat(big), max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"
    assert "at least" in e.value.body["message"]
    _ok(smol)


def test_bodies_python_cannot_take_are_400s(smol):
    """A body nested deeper than Python's JSON parser recurses, a number longer than Python converts (4300
    digits), or a model id that is not a string, is the client's error: a 400 naming it, not a 500 (nor Python's
    advice to call sys.set_int_max_str_digits, which an HTTP client cannot follow)."""
    deep = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    status, body = smol.raw("/v1/chat/completions", deep)
    assert status == 400 and "nest too deeply" in body["error"]["message"]
    status, body = smol.raw("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}")
    assert status == 400 and "malformed JSON" in body["error"]["message"], body
    assert "4300 digits" in body["error"]["message"] and "sys." not in body["error"]["message"], body
    for model in (["smollm2"], {"id": "smollm2"}):
        status, body = smol.raw("/v1/completions", json.dumps({"model": model, "prompt": "hi"}).encode())
        assert status == 400 and body["error"]["param"] == "model" and "string" in body["error"]["message"]
    _ok(smol)


def test_lone_surrogates_are_400s_naming_where(smol):
    """JSON's \\ud800 escape decodes to a lone UTF-16 surrogate, which is not Unicode text and which no UTF-8
    response can carry: a 400 naming where it is (it was a 500, or a stream cut off mid-way), while an escaped
    surrogate pair is the one character it encodes."""
    for path, body, where in (
            ("/v1/completions", r'{"prompt": "a\udfffb", "echo": true, "max_tokens": 1}', "prompt"),
            ("/v1/completions", r'{"prompt": "a\udfffb", "echo": true, "stream": true, "max_tokens": 1}', "prompt"),
            ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi"}, '
                                     r'{"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]}',
             "messages[1].content[0].text")):
        status, r = smol.raw(path, body.encode())
        assert status == 400, (body, r)
        assert where in r["error"]["message"] and "surrogate" in r["error"]["message"]
        assert r["error"]["param"] == where.split("[")[0]
    status, r = smol.raw("/v1/completions", rb'{"prompt": "\ud83d\udc09", "echo": true, "max_tokens": 1}')
    assert status == 200 and r["choices"][0]["text"].startswith("\N{DRAGON}")
    _ok(smol)


def test_boolean_parameters_take_only_booleans(smol):
    """A string "false" is true to Python: where OpenAI documents a boolean, anything else is a 400 naming it (a
    request with "stream": "false" was streamed). null is the parameter's default."""
    msgs = _chat("Hi")
    for path, req, param in (("/v1/chat/completions", {"messages": msgs, "stream": "false"}, "stream"),
                             ("/v1/chat/completions", {"messages": msgs, "logprobs": "yes"}, "logprobs"),
                             ("/v1/completions", {"prompt": "Hi", "echo": 1}, "echo"),
                             ("/v1/completions", {"prompt": "Hi", "stream": True,
                                                  "stream_options": {"include_usage": "no"}}, "stream_options")):
        status, r = smol.raw(path, json.dumps({"max_tokens": 2, **req}).encode())
        assert status == 400 and r["error"]["param"] == param, (req, r)
    status, r = smol.raw("/v1/chat/completions", json.dumps({"messages": msgs, "max_tokens": 2, "stream": None,
                                                             "logprobs": None}).encode())
    assert status == 200 and r["object"] == "chat.completion" and r["choices"][0]["logprobs"] is None
    _ok(smol)


def test_several_choices_with_an_echoed_prompt_are_refused_before_any_work(smol):
    """OpenAI's legacy completions give each of n choices its own text, so with echo each would repeat the prompt
    (and with logprobs its scores). pyllm generates one choice per request (as llama.cpp's server, which answers
    "Only one completion choice is allowed"), so n > 1 is a 400 naming n whatever echo, logprobs and stream say,
    before the prompt is scored or anything generated (the token counters do not move)."""
    before = smol.metrics()
    for extra in ({}, {"logprobs": 1}, {"logprobs": 1, "stream": True}, {"stream": True}, {"max_tokens": 0}):
        req = {"prompt": "Hello there", "echo": True, "n": 2, "max_tokens": 2, **extra}
        status, r = smol.raw("/v1/completions", json.dumps(req).encode())
        assert status == 400 and r["error"]["param"] == "n" and r["error"]["message"].startswith("n=2: "), (req, r)
    after = smol.metrics()
    for name in ("pyllm_prompt_tokens_total", "pyllm_generated_tokens_total"):
        assert after[name] == before[name], name
    _ok(smol)


def test_missing_inputs_are_400s_and_unknown_parameters_are_ignored(smol):
    """A request without its messages, prompt or input is a 400 naming it; a parameter the server does not know
    is ignored, as OpenAI-compatible servers ignore them, whatever its name (one named like a Python argument of
    pyllm's own functions, such as "self" or "llm", was a 500)."""
    for path, param in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt"),
                        ("/v1/embeddings", "input")):
        status, r = smol.raw(path, b'{"max_tokens": 2}')
        assert status == 400 and r["error"]["param"] == param and "missing" in r["error"]["message"], r
    stray = {"self": 1, "llm": 2, "cancel": True, "ignored": 3, "speculative": "draft", "user": "u1"}
    want = smol.client().chat.completions.create(model="smollm2", messages=_chat("Hi"), max_tokens=3,
                                                 temperature=0).choices[0].message.content
    status, r = smol.raw("/v1/chat/completions", json.dumps({"messages": _chat("Hi"), "max_tokens": 3,
                                                             "temperature": 0, **stray}).encode())
    assert status == 200 and r["choices"][0]["message"]["content"] == want
    status, r = smol.raw("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 3, **stray}).encode())
    assert status == 200 and r["usage"]["completion_tokens"] == 3
    status, r = smol.raw("/v1/embeddings", json.dumps({"input": "Hi", **stray}).encode())
    assert status == 200 and len(r["data"]) == 1
    _ok(smol)


def test_malformed_tool_calls_and_tool_choice_are_400s(smol):
    """Tool-call fields of the wrong shape in the history or in tool_choice are a 400 naming the parameter (they
    were 500s: a string where an object belongs, a list as a call id)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    bad_history = [{"tool_calls": "x"}, {"tool_calls": ["x"]}, {"tool_calls": [5]},
                   {"tool_calls": [{**call, "function": "f"}]}, {"tool_calls": [{**call, "id": ["call_1"]}]},
                   {"tool_calls": [{**call, "function": {"arguments": "{}"}}]}]
    for extra in bad_history:
        msgs = _chat("Hi") + [{"role": "assistant", "content": None, **extra}]
        status, r = smol.raw("/v1/chat/completions", json.dumps({"messages": msgs, "max_tokens": 2}).encode())
        assert status == 400 and r["error"]["param"] == "messages" and "messages[1].tool_calls" in \
            r["error"]["message"], (extra, r)
    msgs = _chat("Hi") + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": ["call_1"], "content": "1"}]
    status, r = smol.raw("/v1/chat/completions", json.dumps({"messages": msgs, "max_tokens": 2}).encode())
    assert status == 400 and "messages[2].tool_call_id" in r["error"]["message"], r
    for choice in ({"type": "function", "function": "f"}, {"type": "function", "function": ["f"]}, ["f"]):
        status, r = smol.raw("/v1/chat/completions", json.dumps({"messages": _chat("Hi"), "tools": tools,
                                                                 "tool_choice": choice, "max_tokens": 2}).encode())
        assert status == 400 and r["error"]["param"] == "tool_choice", (choice, r)
    msgs[1]["content"], msgs[2]["tool_call_id"] = "", "call_1"  # the well-formed history is served
    status, r = smol.raw("/v1/chat/completions", json.dumps({"messages": msgs, "tools": tools,
                                                             "max_tokens": 2}).encode())
    assert status == 200, r
    _ok(smol)


def test_invalid_structured_output_is_a_400_before_a_stream_starts(smol):
    """An invalid or unsatisfiable JSON schema, or a grammar that does not parse, is a 400 naming its parameter,
    streamed or not: arguments are checked before anything is generated (a chat stream answered 200 and sent the
    error as an event after its first chunk, with no parameter named)."""
    def schema(s):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}

    cases = [("/v1/chat/completions", {"messages": _chat("Hi"), **schema({"type": "nonsense"})}, "response_format"),
             ("/v1/chat/completions", {"messages": _chat("Hi"), **schema({"type": "integer", "minimum": 5,
                                                                          "maximum": 3})}, "response_format"),
             ("/v1/chat/completions", {"messages": _chat("Hi"), **schema({"$ref": "#/$defs/n", "$defs": {
                 "n": {"$ref": "#/$defs/n"}}})}, "response_format"),  # compiles, but allows no first token
             ("/v1/chat/completions", {"messages": _chat("Hi"), "grammar": "root ::= (("}, "grammar"),
             ("/v1/chat/completions", {"messages": _chat("Hi"), "tool_choice": {"type": "function",
                                                                                "function": {"name": "f"}},
                                       "tools": [{"type": "function", "function": {
                                           "name": "f", "parameters": {"type": "zzz"}}}]}, "tools"),
             ("/v1/completions", {"prompt": "Hi", **schema({"type": "nonsense"})}, "response_format"),
             ("/v1/completions", {"prompt": "Hi", "grammar": "root ::= (("}, "grammar")]
    for path, req, param in cases:
        for stream in (False, True):
            status, r = smol.raw(path, json.dumps({**req, "max_tokens": 4, "stream": stream}).encode())
            assert status == 400 and r["error"]["param"] == param, (req, stream, r)
    status, r = smol.raw("/v1/chat/completions", json.dumps({"messages": _chat("Hi"), "max_tokens": 8, "stream": True,
                                                             **schema({"type": "integer"})}).encode())
    assert status == 200 and r.rstrip().endswith("data: [DONE]")
    _ok(smol)


def test_openai_parse_with_pydantic_models(smol):
    """The official client's chat.completions.parse, the usual way its users ask for structured output, sends
    pydantic's JSON schema (strict: $defs, $ref, anyOf with null, a discriminated union's oneOf with a const per
    branch, enums, bounds, a pattern, a date format) and parses the reply into the model. Each reply here must
    parse and validate (pydantic is the reference); an overlapping oneOf is a 400 naming response_format."""
    import datetime
    import enum
    from typing import Literal, Optional, Union

    from pydantic import BaseModel, Field

    class Color(str, enum.Enum):
        red = "red"
        green = "green"

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(BaseModel):
        kind: Literal["dog"]
        good: bool

    class Pet(BaseModel):
        pet: Union[Cat, Dog] = Field(discriminator="kind")
        color: Color
        nickname: Optional[str]

    class Bounded(BaseModel):
        n: int = Field(ge=1, le=10)
        ratio: float = Field(gt=0, lt=1)
        tag: str = Field(pattern=r"^[a-z]{3}$")
        when: datetime.date

    client = smol.client()
    for model in (Pet, Bounded):
        r = client.chat.completions.parse(model="smollm2", messages=_chat(f"Give an example {model.__name__} as JSON."),
                                          response_format=model, temperature=0, max_tokens=64)
        assert r.choices[0].finish_reason == "stop", r
        assert isinstance(r.choices[0].message.parsed, model), r

    overlapping = {"type": "object", "properties": {"n": {"oneOf": [{"type": "integer", "minimum": 0},
                                                                   {"type": "integer", "maximum": 10}]}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=_chat("Hi"), max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": overlapping}})
    assert e.value.body["param"] == "response_format" and "coerce_one_of" in e.value.body["message"], e.value.body


def test_sampler_settings_are_checked_and_named(smol):
    """Every sampler setting of the wrong type or out of the sampler's range is a 400 naming it (typical_p of the
    wrong type was a 500; the sampler's own range checks named no parameter; a logit_bias value out of OpenAI's
    [-100, 100] named the parameter "logit_bias value", which no request has)."""
    for kw in ({"typical_p": "x"}, {"typical_p": [1]}, {"typical_p": 0}, {"typical_p": 1.5}, {"min_p": 1},
               {"repeat_penalty": 0}, {"top_k": -1}, {"logit_bias": {"5": 101}}, {"logit_bias": {"5": "x"}}):
        for path, req in (("/v1/chat/completions", {"messages": _chat("Hi")}), ("/v1/completions", {"prompt": "Hi"})):
            status, r = smol.raw(path, json.dumps({**req, **kw, "max_tokens": 2}).encode())
            assert status == 400 and r["error"]["param"] == next(iter(kw)), (kw, r)
    status, r = smol.raw("/v1/completions", json.dumps({"prompt": "Hi", "typical_p": 0.9, "min_p": 0.0,
                                                        "max_tokens": 2}).encode())
    assert status == 200, r
    _ok(smol)


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


def test_echo_with_logprobs_scores_the_prompt(smol, smol_llm):
    check_echoed_prompt_logprobs(smol, smol_llm)


def test_echo_with_logprobs_reports_no_cache_reuse_of_its_own_scoring(smol):
    """The prompt-scoring pass evaluates the whole prompt from position 0 and leaves it in the cache, and the
    generation then reused it: cached_tokens read prompt_tokens - 1 and pyllm_prompt_cache_tokens_total grew by
    that, though the request computed every token itself. Reference: OpenAI's cached_tokens, the prompt tokens
    reused from earlier requests; exact counts."""
    prompt, kw = "A long prompt about caching, to be echoed with its scores.", dict(max_tokens=2, temperature=0)
    c = smol.client()
    c.completions.create(model="smollm2", prompt=prompt, **kw)  # the cache now holds the prompt
    before = smol.metrics()["pyllm_prompt_cache_tokens_total"]
    r = c.completions.create(model="smollm2", prompt=prompt, echo=True, logprobs=1, **kw)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert smol.metrics()["pyllm_prompt_cache_tokens_total"] == before
    r = c.completions.create(model="smollm2", prompt=prompt, **kw)  # an earlier request's rows: reuse
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached >= r.usage.prompt_tokens - 1 and smol.metrics()["pyllm_prompt_cache_tokens_total"] == before + cached


def test_top_logprobs_without_logprobs_and_best_of_are_400s(smol):
    """Both were ignored. Reference: OpenAI's API (400 for top_logprobs without logprobs: true); best_of other than
    1 would need several candidates, which pyllm does not generate. Audio output (modalities with "audio", audio
    settings) was ignored too, and the reply had no message.audio where the client asked for one, as was
    web_search_options (a reply as if searched, without any search); OpenAI's API answers 400 for a model without
    either. ["text"] alone is the default and is served."""
    c = smol.client()
    for kw, param in ((dict(modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}), "audio"),
                      (dict(modalities=["audio"]), "modalities"), (dict(web_search_options={}), "web_search_options")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="smollm2", messages=_chat("Hi"), max_tokens=2, **kw)
        assert e.value.body["param"] == param
    assert c.chat.completions.create(model="smollm2", messages=_chat("Hi"), max_tokens=2,
                                     modalities=["text"]).usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="smollm2", messages=_chat("Hi"), max_tokens=2, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="smollm2", prompt="Hi", max_tokens=2, best_of=3, stream=stream)
        assert e.value.body["param"] == "best_of" and "best_of" in e.value.message
    assert c.completions.create(model="smollm2", prompt="Hi", max_tokens=2, best_of=1).usage.completion_tokens == 2


def test_top_logprobs_bytes_are_the_tokens_own(smol):
    """top_logprobs[].bytes are each token's own bytes, as the chosen token's are (they were the UTF-8 of its text
    with U+FFFD for a token that is part of a character). Greedy: the first alternative is the chosen token."""
    r = smol.client().chat.completions.create(model="smollm2", messages=_chat("h\u00e9llo \N{DRAGON} end"),
                                              max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    partial = 0
    for t in content:
        assert t.top_logprobs[0].bytes == t.bytes and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        try:
            bytes(t.bytes).decode()
        except UnicodeDecodeError:
            partial += 1
    assert partial  # the reply has tokens that are parts of a character (the dragon's four bytes)


def test_errors_name_the_parameter_the_request_used(smol):
    """A prompt longer than the context is a fault of "prompt" on /v1/completions (it named "messages"), and a bad
    max_completion_tokens is named as such (it was named max_tokens, which the request did not send)."""
    with pytest.raises(openai.BadRequestError) as e:
        smol.client().completions.create(model="smollm2", prompt="word " * 700, max_tokens=2, stream=True)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        smol.client().chat.completions.create(model="smollm2", messages=_chat("word " * 700), max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"
    for bad in (-2, 1.5, "8"):
        with pytest.raises(openai.BadRequestError) as e:
            smol.client().chat.completions.create(model="smollm2", messages=_chat("Hi"), max_completion_tokens=bad)
        assert e.value.body["param"] == "max_completion_tokens" and "max_completion_tokens" in e.value.message
    r = smol.client().chat.completions.create(model="smollm2", messages=_chat("Hi"), max_completion_tokens=2)
    assert r.usage.completion_tokens == 2


def test_tool_round_trip_on_a_template_without_tool_calls(smol):
    """OpenAI's tool flow sends the assistant's call back with null content. SmolLM2's template renders neither
    tool_calls nor a null content (it was a 400 "chat template failed: TypeError"); the call is written into the
    turn in the <tool_call> convention the fallback tool prompt teaches, so the model sees what it called.
    Reference: the same history with that text as the assistant's content."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    c = smol.client()
    replies = []
    for turn in ({"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "assistant", "content": written}):
        msgs = _chat("What is the weather in Paris?") + [turn, {"role": "tool", "tool_call_id": "call_1",
                                                                "content": "sunny"}]
        r = c.chat.completions.create(model="smollm2", messages=msgs, tools=tools, max_tokens=6, temperature=0)
        replies.append((r.usage.prompt_tokens, r.choices[0].message.content))
    assert replies[0] == replies[1]



def test_parallel_tool_calls_false_returns_at_most_one_call(smol):
    """parallel_tool_calls: false promises at most one call (a client may run the first and answer it alone); it
    was ignored, and a reply with two calls returned both. A grammar makes the reply two calls whatever the model;
    a value that is not a boolean is a 400 naming it."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    calls = "\n".join('<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>' % city
                      for city in ("Paris", "Rome"))
    kw = dict(model="smollm2", messages=_chat("Weather in Paris and Rome?"), tools=tools, max_tokens=80,
              extra_body={"grammar": "root ::= " + json.dumps(calls)})
    c = smol.client()
    for parallel, want in ((None, ["Paris", "Rome"]), (True, ["Paris", "Rome"]), (False, ["Paris"])):
        more = {} if parallel is None else {"parallel_tool_calls": parallel}
        r = c.chat.completions.create(**kw, **more)
        assert r.choices[0].finish_reason == "tool_calls"
        assert [json.loads(t.function.arguments)["city"] for t in r.choices[0].message.tool_calls] == want
        deltas = [t for ch in c.chat.completions.create(**kw, **more, stream=True) if ch.choices
                  for t in ch.choices[0].delta.tool_calls or []]
        assert [json.loads(t.function.arguments)["city"] for t in deltas] == want, parallel
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**kw, parallel_tool_calls="false")
    assert e.value.body["param"] == "parallel_tool_calls"

def test_roles_are_openais(smol):
    """A message role outside OpenAI's (system, developer, user, assistant, tool, function) is a 400 naming the
    message, as OpenAI's API answers; it was rendered into the prompt as a turn of that name."""
    for role in ("wizard", "", "USER"):
        status, r = smol.raw("/v1/chat/completions", json.dumps({"messages": _chat("Hi") + [
            {"role": role, "content": "x"}], "max_tokens": 2}).encode())
        assert status == 400 and r["error"]["param"] == "messages" and "messages[1].role" in r["error"]["message"]
    r = smol.client().chat.completions.create(model="smollm2", max_tokens=2, messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert r.usage.completion_tokens == 2



def test_content_parts_an_assistant_sends_back_are_read_and_images_are_named(smol):
    """OpenAI's assistant messages may hold refusal parts ({"type": "refusal", "refusal": text}), which a client
    sends back with the rest of the conversation; they were a 400 "only text parts are supported". Reference: the
    same history with the refusal's text as a string. An image part stays a 400 that names the message and the
    part's type, since the model reads no images."""
    def ask(content):
        return smol.client().chat.completions.create(model="smollm2", max_tokens=1, temperature=0, messages=[
            *_chat("Hi"), {"role": "assistant", "content": content}, *_chat("Why?")]).usage.prompt_tokens

    assert ask([{"type": "refusal", "refusal": "I can't help with that."}]) == ask("I can't help with that.")
    with pytest.raises(openai.BadRequestError) as e:
        smol.client().chat.completions.create(model="smollm2", max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}])
    assert e.value.body["param"] == "messages" and "messages[0].content" in e.value.message
    assert "image_url" in e.value.message


def _metrics_after_one_cancel(server, before: dict, within: float = 60) -> dict:
    """The metrics once the worker has counted one more cancelled request (bounded wait: ``within`` s)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["pyllm_requests_cancelled_total"] > before["pyllm_requests_cancelled_total"]:
            break
        time.sleep(0.2)
    m = server.metrics()
    assert m["pyllm_requests_cancelled_total"] == before["pyllm_requests_cancelled_total"] + 1
    return m


def test_disconnect_mid_stream_frees_the_worker(smol):
    before = smol.metrics()
    c = smol.client()
    stream = c.chat.completions.create(model="smollm2", messages=_chat("Tell a very long story about a dragon."),
                                       max_tokens=400, temperature=0, stream=True)
    got = 0
    for ch in stream:
        got += 1
        if got == 4:
            break
    stream.close()  # drops the connection
    m = _metrics_after_one_cancel(smol, before)
    assert m["pyllm_requests_processing"] == 0
    generated = m["pyllm_generated_tokens_total"] - before["pyllm_generated_tokens_total"]
    assert 3 <= generated < 400  # stopped soon after the client left, not at max_tokens
    _ok(smol)


def _post_and_leave(smol, path: str, body: bytes) -> None:
    """POSTs ``body`` on a raw socket, waits until the server is processing it, then closes the connection."""
    with socket.create_connection(("127.0.0.1", smol.port), timeout=30) as s:
        s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
                  b"\r\n\r\n" + body)
        deadline = time.monotonic() + 60
        while smol.metrics()["pyllm_requests_processing"] == 0:
            assert time.monotonic() < deadline, "the server did not start on the request within 60 s"
            time.sleep(0.1)
        time.sleep(0.5)


def test_disconnect_while_waiting_for_a_whole_response_cancels_it(smol):
    before = smol.metrics()
    body = json.dumps({"model": "smollm2", "messages": _chat("Tell a very long story about a dragon."),
                       "max_tokens": 400, "temperature": 0}).encode()
    _post_and_leave(smol, "/v1/chat/completions", body)
    m = _metrics_after_one_cancel(smol, before)
    assert m["pyllm_generated_tokens_total"] - before["pyllm_generated_tokens_total"] < 400
    _ok(smol)


def test_concurrent_greedy_clients_get_their_solo_text(smol):
    c = smol.client()
    prompts = [f"Count from {i} to {i + 5}." for i in range(8)]

    def ask(p):
        r = c.chat.completions.create(model="smollm2", messages=_chat(p), max_tokens=12, temperature=0)
        return r.choices[0].message.content

    # Every request must find the same cached prefix (the shared "...Count from "), alone or not: a fresh
    # prefill and a reused prefix give slightly different logits (docs/DESIGN.md, Server), so warm the cache first.
    ask("Count from 100 to 105.")
    solo = [ask(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        together = list(ex.map(ask, prompts, timeout=600))
    assert together == solo


def test_embeddings_rank_paraphrases_first(smol):
    texts = ["The cat sat on the mat.", "A cat was sitting on the rug.", "Quarterly revenue rose by eight percent."]
    r = smol.client().embeddings.create(model="smollm2", input=texts)
    v = [d.embedding for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2] and r.usage.prompt_tokens > 0

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b))

    assert all(abs(cos(x, x) - 1) < 1e-4 for x in v)  # L2-normalised
    assert cos(v[0], v[1]) > cos(v[0], v[2]) + 0.1 and cos(v[0], v[1]) > cos(v[1], v[2]) + 0.1
    status, body = smol.raw("/v1/embeddings", json.dumps({"model": "smollm2", "input": []}).encode())
    assert status == 400 and body["error"]["param"] == "input"


def test_disconnect_stops_a_long_embeddings_request(smol):
    """One request may ask for thousands of embeddings (minutes of work); a client that goes away stops it at the
    next text, as it stops a generation at the next token, instead of holding the worker to the end."""
    before = smol.metrics()
    body = json.dumps({"model": "smollm2", "input": ["hi"] * 10000}).encode()  # ~2 minutes of embedding here
    _post_and_leave(smol, "/v1/embeddings", body)
    left = time.monotonic()
    # the worker leaves the processing gauge before it counts the cancel: wait for the count, the later of the two
    m = _metrics_after_one_cancel(smol, before, within=20)
    assert time.monotonic() - left < 20 and m["pyllm_requests_processing"] == 0
    status, body = smol.raw("/v1/embeddings", json.dumps({"input": "hi", "encoding_format": "xml"}).encode())
    assert status == 400 and body["error"]["param"] == "encoding_format"  # the parameter at fault, not "input"
    _ok(smol)


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def qwen():
    s = Server(fixture_path("qwen2"), "--alias", "qwen", "--ctx", "1024", "--cors-origin", "https://ui.example/",
               "--cors-origin", "https://*.tools.example")
    yield s
    s.close()


def test_tool_call_round_trip(qwen):
    c = qwen.client()
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model="qwen", messages=msgs, tools=WEATHER, temperature=0, max_tokens=64)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(c.chat.completions.create(model="qwen", messages=msgs, tools=WEATHER, temperature=0,
                                            max_tokens=64, stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [("get_weather",
                                                                                        {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    msgs += [ch.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "sunny"})}]
    r2 = c.chat.completions.create(model="qwen", messages=msgs, tools=WEATHER, temperature=0, max_tokens=48)
    assert r2.choices[0].finish_reason in ("stop", "length") and r2.choices[0].message.content
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result are in the prompt


def test_tool_choice(qwen):
    c = qwen.client()
    hello = [{"role": "user", "content": "What is the weather in Rome?"}]
    r = c.chat.completions.create(model="qwen", messages=hello, tools=WEATHER, temperature=0, max_tokens=48,
                                  tool_choice="none")
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = c.chat.completions.create(model="qwen", messages=hello, tools=WEATHER, temperature=0, max_tokens=48,
                                      tool_choice=choice)
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="qwen", messages=hello, tools=WEATHER, max_tokens=4,
                                  tool_choice={"type": "function", "function": {"name": "nope"}})



def test_deprecated_functions_are_tools_under_their_old_names(qwen):
    """OpenAI's deprecated functions / function_call (still served by OpenAI, and by llama-cpp-python) were
    ignored: the model never saw the functions. They are tools under their old names, and a call comes back in
    their shape (message.function_call, finish_reason "function_call"); in a history, an assistant's
    function_call and a "function" message are the tool call and its result. Reference: the same conversation
    in the tools form renders the same prompt."""
    c = qwen.client()
    functions = [t["function"] for t in WEATHER]
    kw = dict(model="qwen", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
              functions=functions, function_call={"name": "get_weather"}, temperature=0, max_tokens=48)
    r = c.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "function_call" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.function_call.name == "get_weather"
    assert json.loads(r.choices[0].message.function_call.arguments) == {"city": "Paris"}
    chunks = list(c.chat.completions.create(**kw, stream=True))
    calls = [ch.choices[0].delta.function_call for ch in chunks if ch.choices and ch.choices[0].delta.function_call]
    assert [(f.name, f.arguments) for f in calls] == [("get_weather", r.choices[0].message.function_call.arguments)]
    assert chunks[-1].choices[0].finish_reason == "function_call"
    args = r.choices[0].message.function_call.arguments
    old = [{"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": args}},
           {"role": "function", "name": "get_weather", "content": "sunny"}]
    new = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    a = c.chat.completions.create(**{**kw, "messages": kw["messages"] + old, "function_call": "none", "max_tokens": 1})
    b = c.chat.completions.create(model="qwen", messages=kw["messages"] + new, tools=WEATHER, tool_choice="none",
                                  temperature=0, max_tokens=1)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    for bad, param in ((dict(function_call="auto"), "function_call"), (dict(functions=functions, tools=WEATHER),
                                                                         "functions")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="qwen", messages=kw["messages"], max_tokens=1, **bad)
        assert e.value.body["param"] == param

def test_developer_messages_are_system_messages_to_templates_without_them(qwen):
    """OpenAI's developer role is the system role of newer models. Qwen2.5's template knows neither it nor any
    other role it does not name, and dropped the message (its instructions never reached the model); a template
    that does not name "developer" now gets it as a system message. Reference: the same request with "system"."""
    c = qwen.client()
    got = []
    for role in ("developer", "system"):
        r = c.chat.completions.create(model="qwen", temperature=0, max_tokens=8, messages=[
            {"role": role, "content": "Answer only in French."}, {"role": "user", "content": "Say hello."}])
        got.append((r.usage.prompt_tokens, r.choices[0].message.content))
    assert got[0] == got[1]


def test_forced_call_with_a_schema_that_has_defs(qwen):
    """Tool parameters with "$defs" and "#/$defs/..." references (what pydantic and openai.pydantic_function_tool
    write) are a valid schema; forcing that tool embedded them under the call object, where the references no
    longer resolved (a 400 "Pointer '/$defs/City' does not exist"). The call's arguments follow the schema."""
    jsonschema = pytest.importorskip("jsonschema")
    params = {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
              "additionalProperties": False,
              "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
                                 "required": ["name"], "additionalProperties": False}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    r = qwen.client().chat.completions.create(
        model="qwen", messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, max_tokens=64)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), params)


def test_forced_call_keeps_each_tools_own_defs(qwen):
    """Two tools whose parameters define the same "$defs" name differently could not share the root's $defs, and
    tool_choice "required" fell back to an unconstrained call (arguments of neither schema). Each tool's schema
    now keeps its own definitions. Reference: jsonschema's validation against the called tool's parameters."""
    jsonschema = pytest.importorskip("jsonschema")

    def tool(name, place):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"],
            "additionalProperties": False, "$defs": {"Place": place}}}}

    tools = [tool("get_weather", {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                                  "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "country": {"type": "string", "pattern": "^[A-Z]{2}$"}}}),
             tool("get_time", {"type": "object", "additionalProperties": False, "required": ["utc_offset"],
                               "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}}})]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for msg, choice in (("What time is it in Tokyo?", "required"), ("Weather in Paris?", "required"),
                        ("Weather in Paris?", {"type": "function", "function": {"name": "get_time"}})):
        r = qwen.client().chat.completions.create(model="qwen", messages=[{"role": "user", "content": msg}],
                                                  tools=tools, tool_choice=choice, temperature=0, max_tokens=64)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name in params, (msg, choice)
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
        if isinstance(choice, dict):
            assert call.function.name == "get_time"


def test_required_tool_choice_calls_a_declared_tool(qwen):
    """tool_choice "required" must produce a call to one of the request's tools, with arguments under its schema,
    as OpenAI's API guarantees; asked something no tool fits, the model made up a function ("hello") and the
    server returned that call."""
    jsonschema = pytest.importorskip("jsonschema")
    c = qwen.client()
    for msg in ("hello", "What is the weather in Rome?"):
        r = c.chat.completions.create(model="qwen", messages=[{"role": "user", "content": msg}], tools=WEATHER,
                                      tool_choice="required", temperature=0, max_tokens=64)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather", msg
        jsonschema.validate(json.loads(call.function.arguments), WEATHER[0]["function"]["parameters"])


def test_a_chat_over_the_template_output_limit_is_context_length_exceeded(qwen):
    """Over 1 MB of content reached the chat template's output limit and came back as a 400 blaming the template,
    with no code. Reference: OpenAI's code for too-long input, context_length_exceeded, as the server gives for a
    prompt over the context; the message names the limit."""
    for sizes in ([1_200_000], [600_000, 600_000]):
        msgs = [{"role": ("user", "assistant")[i % 2], "content": "word " * (n // 5)} for i, n in enumerate(sizes)]
        with pytest.raises(openai.BadRequestError) as e:
            qwen.client().chat.completions.create(model="qwen", messages=msgs, max_tokens=2)
        assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"
        assert "1048576 characters" in e.value.body["message"] and "template is runaway" not in e.value.message
    r = qwen.client().chat.completions.create(model="qwen", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2)
    assert r.usage.completion_tokens == 2


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


def test_cors_lets_local_pages_in_and_no_others(smol):
    body = json.dumps({"model": "smollm2", "prompt": "Hi", "max_tokens": 1, "temperature": 0}).encode()
    for origin in ("http://localhost:3000", "https://127.0.0.1", "http://[::1]:5173", "http://0.0.0.0:8000",
                   "tauri://localhost", "app://obsidian.md"):
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/models"):
            # the preflight is answered before the API-key check: browsers send it without the key
            status, h = _cors(smol, path, origin)
            assert status == 200 and h["access-control-allow-origin"] == origin, (origin, path, h)
            allowed = {x.strip().lower() for x in h["access-control-allow-headers"].split(",")}
            assert {"authorization", "content-type", "x-stainless-os"} <= allowed
            assert "POST" in h["access-control-allow-methods"]
        status, h = _cors(smol, "/v1/completions", origin, "POST", body, key=KEY)
        assert status == 200 and h["access-control-allow-origin"] == origin
    # a page can read the refusal of a wrong key, and no page from elsewhere learns anything
    status, h = _cors(smol, "/v1/completions", "http://localhost:3000", "POST", body, key="wrong")
    assert status == 401 and h["access-control-allow-origin"] == "http://localhost:3000"
    for origin in ("https://evil.example", "http://localhost.evil.example", "http://127.0.0.1.evil.example:80",
                   "https://ui.example", "null"):
        status, h = _cors(smol, "/v1/chat/completions", origin)
        assert status == 400 and h == {}, (origin, h)
        status, h = _cors(smol, "/v1/completions", origin, "POST", body, key=KEY)
        assert status == 200 and h == {}, (origin, h)


def test_cors_origin_flag_adds_origins(qwen):
    for origin in ("https://ui.example", "https://a.tools.example", "http://localhost:3000"):
        status, h = _cors(qwen, "/v1/chat/completions", origin)
        assert status == 200 and h["access-control-allow-origin"] == origin, (origin, h)
    for origin in ("https://evil.example", "http://ui.example", "https://ui.example.evil"):
        status, h = _cors(qwen, "/v1/chat/completions", origin)
        assert status == 400 and h == {}, (origin, h)


def test_cors_origin_star_lets_every_page_in():
    import asyncio

    from pyllm.server.app import with_cors

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    def ask(method: str, headers: dict) -> tuple[int, dict]:
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "method": method, "path": "/v1/chat/completions", "query_string": b"",
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
        asyncio.run(with_cors(app, ["*"])(scope, receive, send))
        return sent[0]["status"], {k.decode(): v.decode() for k, v in sent[0]["headers"]}

    status, h = ask("OPTIONS", {"Origin": "https://any.example", "Access-Control-Request-Method": "POST",
                                "Access-Control-Request-Headers": "authorization"})
    assert status == 200 and h["access-control-allow-origin"] == "*"
    status, h = ask("POST", {"Origin": "https://any.example"})
    assert status == 200 and h["access-control-allow-origin"] == "*"


def test_a_500_from_an_exception_no_handler_caught_carries_cors_headers(smol_llm):
    """Starlette answers an exception that escapes every handler with a 500 from its ServerErrorMiddleware, which
    sat outside the CORS middleware: a page could not read that one error."""
    import asyncio

    from pyllm.server.app import create_app

    app = create_app(smol_llm, "smollm2")

    async def broken(request):
        raise RuntimeError("a bug")

    app.add_route("/v1/broken", broken)
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "http_version": "1.1", "scheme": "http", "method": "GET", "path": "/v1/broken",
             "raw_path": b"/v1/broken", "root_path": "", "query_string": b"", "server": ("127.0.0.1", 8080),
             "client": ("127.0.0.1", 50000), "headers": [(b"host", b"x"), (b"origin", b"http://localhost:3000")]}
    try:
        with pytest.raises(RuntimeError, match="a bug"):  # re-raised after the response, for the server to log
            asyncio.run(app(scope, receive, send))
    finally:
        app.state.scheduler.close()
    headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    assert sent[0]["status"] == 500 and headers["access-control-allow-origin"] == "http://localhost:3000"
    assert json.loads(sent[1]["body"])["error"]["type"] == "server_error"


def _readme_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Serve")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def test_readme_serve_examples_run_against_a_live_server(smol):
    sec = _readme_section()
    curl = re.search(r"```bash\n(curl .*?)\n```", sec, re.S).group(1)
    py = re.search(r"```python\n(.*?)\n```", sec, re.S).group(1)
    port = str(smol.port)
    fix = lambda s: s.replace("8080", port).replace("smollm2-135m", "smollm2").replace("sk-no-key", KEY)  # noqa: E731
    out = subprocess.run(["bash", "-c", fix(curl).replace("curl ", f"curl -sS -H 'Authorization: Bearer {KEY}' ", 1)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["choices"][0]["message"]["content"]
    out = subprocess.run([sys.executable, "-c", fix(py)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_serve_cli_errors_are_one_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # a value out of range is a usage error (exit 2) as for every subcommand's flags; a port in use is not
        for args, msg, rc, head in ((["--port", str(port)], "cannot listen on 127.0.0.1", 1, "pyllm: error: "),
                                    (["--parallel", "0"], "--parallel", 2, "pyllm serve: error: "),
                                    (["--port", "70000"], "--port", 2, "pyllm serve: error: "),
                                    (["--max-body", "0"], "--max-body: must be >= 1", 2, "pyllm serve: error: "),
                                    (["--client-timeout", "0"], "--client-timeout: must be in [1, ", 2,
                                     "pyllm serve: error: "),
                                    (["--cors-origin", "https://ui.example/chat"], "is not an origin", 1,
                                     "pyllm: error: ")):
            r = subprocess.run([sys.executable, "-m", "pyllm.cli.main", "serve", "smollm2-135m", *args], cwd=ROOT,
                               env=env, capture_output=True, text=True, timeout=120)
            assert r.returncode == rc and r.stderr.startswith(head) and msg in r.stderr, r.stderr
            assert len(r.stderr.strip().splitlines()) == 1


def _ipv6_loopback() -> bool:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_serve_on_ipv6_and_port_0_names_the_port_it_listens_on():
    """--host ::1 was refused by the check that the address can be bound (an IPv4 socket), and with --port 0 the
    banner said port 0 instead of the one the system chose."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "pyllm.cli.main", "serve", fixture_path("smollm2"), "--host", "::1",
                             "--port", "0", "--threads", "1", "--ctx", "256"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:  # ends when the process does
            lines.append(line)
            m = re.search(r"on http://\[::1\]:(\d+)/v1", line)
            if m:
                break
        assert m and int(m.group(1)) > 0, lines
        with urllib.request.urlopen(f"http://[::1]:{m.group(1)}/health", timeout=60) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def test_an_endless_request_head_is_refused_and_the_server_keeps_serving(smol):
    """A request head over MAX_HEAD_BYTES is answered 400 and the connection closed: the HTTP parser uvicorn picks
    by default (httptools) kept every header byte, so one client could take the server's memory."""
    import socket

    from pyllm.server.app import MAX_HEAD_BYTES

    s = socket.create_connection(("127.0.0.1", smol.port), timeout=60)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        reply = b""
        try:
            for _ in range(4 * MAX_HEAD_BYTES // 8192):
                s.sendall(b"a" * 8192)
        except OSError:  # closed by the server before the whole header was sent
            pass
        while chunk := s.recv(4096):
            reply += chunk
    except OSError:
        pass
    finally:
        s.close()
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    _ok(smol)


def test_sigterm_ends_the_server_while_a_client_never_finishes_its_body():
    """A client that announces a body and never sends it kept `pyllm serve` from exiting on SIGTERM: uvicorn waited
    for the request without end. Requests in flight now get SHUTDOWN_GRACE_S seconds."""
    import socket

    from pyllm.server.app import SHUTDOWN_GRACE_S

    s = Server(fixture_path("smollm2"), "--ctx", "256")
    c = socket.create_connection(("127.0.0.1", s.port), timeout=60)
    try:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{")
        time.sleep(0.5)
        t = time.monotonic()
        s.proc.terminate()
        s.proc.wait(timeout=SHUTDOWN_GRACE_S + 30)
        assert time.monotonic() - t < SHUTDOWN_GRACE_S + 20
        assert "Traceback" not in s.proc.stdout.read()
    finally:
        c.close()
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


CLIENT_TIMEOUT = 1  # the brisk server's --client-timeout, seconds
SLACK = 3  # what a loaded 2-core machine adds to a deadline before the server acts on it, seconds


@pytest.fixture(scope="module")
def brisk():
    s = Server(fixture_path("smollm2"), "--alias", "smollm2", "--ctx", "256", "--client-timeout", str(CLIENT_TIMEOUT))
    yield s
    s.close()


def _read_to_close(c: socket.socket, since: float) -> tuple[bytes, float]:
    """(all the server sent, seconds from ``since`` until it closed the connection)."""
    reply = b""
    try:
        while chunk := c.recv(65536):
            reply += chunk
    except OSError:  # reset instead of closed: the time still counts
        pass
    return reply, time.monotonic() - since


def test_stalled_request_heads_are_closed_at_the_client_timeout_and_others_are_served(brisk):
    """A connection that never finishes a request head (no byte at all, half a head, or half of the next head after
    a response) is closed --client-timeout seconds after the server began waiting for the head, with a 408 when part
    of one came: they were held open without end. Requests on other connections are answered meanwhile."""
    heads = [b"", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: a", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /he"]
    conns = []
    try:
        for i in range(60):
            c = socket.create_connection(("127.0.0.1", brisk.port), timeout=CLIENT_TIMEOUT + SLACK + 10)
            conns.append((c, time.monotonic(), heads[i % 3]))
            c.sendall(heads[i % 3])
        for _ in range(3):
            t = time.monotonic()
            assert brisk.raw("/health") == (200, {"status": "ok"})
            assert time.monotonic() - t < CLIENT_TIMEOUT  # answered while all 60 are held
        for c, since, head in conns:
            reply, took = _read_to_close(c, since)
            assert CLIENT_TIMEOUT - 0.1 < took < CLIENT_TIMEOUT + SLACK, (head, took)
            if not head:
                assert reply == b""  # a connection that never asked gets no answer, as with an idle keep-alive one
            elif head.count(b"GET") == 1:
                assert reply.startswith(b"HTTP/1.1 408 ") and b"--client-timeout" in reply, reply
            else:
                assert reply.startswith(b"HTTP/1.1 200 ") and b"}HTTP/1.1 408 " in reply, reply
    finally:
        for c, _, _ in conns:
            c.close()
    assert brisk.raw("/health")[0] == 200


def _post_in_pieces(server, body: bytes, pieces: list[tuple[float, int]]) -> tuple[bytes, float]:
    """(the reply, seconds until the server closed or answered in full) of a POST /v1/completions announcing
    ``body`` whole, then sending it as (pause in seconds, bytes) ``pieces``, stopping at the first refusal."""
    c = socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT + SLACK + 60)
    with c:
        t = time.monotonic()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                  b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n" % (KEY.encode(), len(body)))
        at = 0
        try:
            for pause, n in pieces:
                time.sleep(pause)
                c.sendall(body[at:at + n])
                at += n
        except OSError:  # the server answered and closed first
            pass
        return _read_to_close(c, t)


def test_a_stalled_or_trickling_body_is_a_408_before_model_work_and_a_steady_one_is_not(brisk):
    """A body that stops, or trickles in a byte at a time, is a 408 --client-timeout seconds in (plus what it sent at
    500 bytes/s) and no generation starts: the request held its connection and a task forever. A body arriving in
    pieces for longer than the deadline, none of them late, and a streamed response of 240 tokens (over a second
    on a 2-core machine), go through."""
    body = json.dumps({"model": "smollm2", "prompt": "Hi", "max_tokens": 1, "temperature": 0}).encode()
    body += b" " * (1400 - len(body))
    before = brisk.metrics()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        stalled = pool.submit(_post_in_pieces, brisk, body, [(0, 1)])
        trickled = pool.submit(_post_in_pieces, brisk, body, [(0.2, 1)] * len(body))
        steady = pool.submit(_post_in_pieces, brisk, body, [(0.3, 200)] * 7)
        stream = brisk.client().completions.create(model="smollm2", prompt="Once upon a time", max_tokens=240,
                                                   temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens == 240
        for f in (stalled, trickled):
            reply, took = f.result()
            assert reply.startswith(b"HTTP/1.1 408 ") and b"--client-timeout" in reply, reply
            assert CLIENT_TIMEOUT - 0.1 < took < CLIENT_TIMEOUT + SLACK, took
        reply, took = steady.result()
    assert reply.startswith(b"HTTP/1.1 200 "), reply
    assert took > 1.8 > CLIENT_TIMEOUT, took
    # only the steady request's prompt and the stream's reached the model (its counters follow a response by a
    # moment, so they are awaited)
    read = json.loads(reply.split(b"\r\n\r\n", 1)[1])["usage"]["prompt_tokens"] + chunks[-1].usage.prompt_tokens
    _, text = brisk.raw("/metrics")
    assert 'pyllm_requests_total{route="/v1/completions",status="408"} 2' in text
    for _ in range(50):
        grown = brisk.metrics()["pyllm_prompt_tokens_total"] - before["pyllm_prompt_tokens_total"]
        if grown >= read:
            break
        time.sleep(0.1)
    assert grown == read
