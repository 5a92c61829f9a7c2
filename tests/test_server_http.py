"""`pyllm serve` as an HTTP service: models and health, error objects, body limits and parsing, client
disconnects, CORS, the README's examples, the command line, request-head and body deadlines.

References: OpenAI's documented error shape (the openai client's exception classes), the server's /metrics
counters, the HTTP bytes on the wire. Every wait is bounded. Server fixtures: conftest.py.
"""

import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from conftest import fixture_path
from server_harness import KEY, MAX_BODY, ROOT, Server, _chat, _cors, _ok, failing_after, served_in_thread


def test_models_and_health(smol):
    ids = [m.id for m in smol.client().models.list().data]
    assert ids == ["smollm2"]
    m = smol.client().models.retrieve("smollm2")  # GET /v1/models/{model}, as OpenAI's API serves it
    assert m.id == "smollm2" and m.object == "model" and m.owned_by == "pyllm"
    assert smol.client().models.retrieve("gpt-9/x").id == "smollm2"  # one model served: every name is it
    assert smol.raw("/health", key=None) == (200, {"status": "ok"})


def test_errors_are_openai_objects_and_the_server_keeps_serving(smol):
    c = smol.client()
    # 400: malformed JSON
    status, body = smol.raw("/v1/chat/completions", b'{"model": "smollm2", "messages": [')
    assert status == 400 and "malformed JSON" in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    _ok(smol)
    # 404: unknown route (any model name is the one model served)
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
    # 401: wrong and missing key (health and the model list stay open)
    with pytest.raises(openai.AuthenticationError):
        smol.client(key="sk-wrong").chat.completions.create(model="smollm2", messages=_chat("hi"), max_tokens=2)
    status, body = smol.raw("/v1/models/smollm2", key=None)
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


def test_integers_past_a_doubles_range_are_400s_naming_the_parameter(smol):
    """JSON numbers have no size limit and Python reads 10**400 as an int, which every numeric parameter's range
    check turned into a float: an OverflowError, a 500 "internal error". Reference: OpenAI's error shape, a 400
    naming the parameter as for any other out-of-range value, on every route that takes numbers."""
    big = "1" + "0" * 400
    cases = [("/v1/chat/completions", '"messages": [{"role": "user", "content": "Hi"}], "logprobs": true',
              ("temperature", "top_p", "top_k", "min_p", "typical_p", "repeat_penalty", "presence_penalty",
               "frequency_penalty", "seed", "max_tokens", "max_completion_tokens", "top_logprobs")),
             ("/v1/completions", '"prompt": "Hi"', ("max_tokens", "logprobs", "best_of", "seed", "temperature")),
             ("/v1/responses", '"input": "Hi"', ("max_output_tokens", "temperature", "top_p", "seed")),
             ("/v1/embeddings", '"input": "Hi"', ("dimensions",))]
    for path, head, params in cases:
        for param in params:
            for v in (big, "-" + big):
                status, r = smol.raw(path, f'{{{head}, "{param}": {v}}}'.encode())
                assert status == 400 and r["error"]["param"] == param, (path, param, v[:3], r)
    status, r = smol.raw("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "Hi"}}], '
                                                  f'"logit_bias": {{"5": {big}}}}}'.encode())
    assert status == 400 and r["error"]["param"] == "logit_bias", r
    _ok(smol)


def test_nan_infinity_and_numbers_past_a_double_are_malformed_json(smol):
    """NaN, Infinity and -Infinity are not JSON, and 1e400 is no double; Python's parser read them all as floats.
    /v1/responses echoes metadata, user and tools, so they came back as a 500 (a response cannot carry them), or
    streamed, as "NaN" inside an event, which a client's JSON parser refuses. Reference: RFC 8259 (numbers are
    finite) and OpenAI's API, which refuses such a body as unparseable: a 400 naming the value, before any work."""
    hi = '"input": "Hi", "max_output_tokens": 2'
    for path, body in (("/v1/responses", f'{{{hi}, "metadata": {{"a": NaN}}}}'),
                       ("/v1/responses", f'{{{hi}, "metadata": {{"a": NaN}}, "stream": true}}'),
                       ("/v1/responses", f'{{{hi}, "user": Infinity}}'),
                       ("/v1/responses", f'{{{hi}, "metadata": {{"a": 1e400}}}}'),
                       ("/v1/responses", f'{{{hi}, "tools": [{{"type": "function", "name": "f", "parameters": '
                                         f'{{"type": "object", "properties": {{"a": {{"default": -Infinity}}}}}}}}]}}'),
                       ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
                                                '"temperature": NaN}')):
        status, r = smol.raw(path, body.encode())
        assert status == 400 and r["error"]["message"].startswith("malformed JSON body: "), (body, r)
        assert re.search(r"NaN|Infinity|1e400", r["error"]["message"]), r
    status, r = smol.raw("/v1/responses", f'{{{hi}, "metadata": {{"a": 1e300, "b": 1e-400}}}}'.encode())
    assert status == 200 and r["metadata"] == {"a": 1e300, "b": 0.0}
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


def test_a_model_fault_is_a_server_error_whole_or_mid_stream(smol_llm, monkeypatch):
    """Non-finite logits (broken weights) were a 400 invalid_request_error, a BadRequestError in the openai client:
    the client was told to fix a request that any request would fail the same way. The served model is at fault:
    500 server_error (InternalServerError), and mid-stream OpenAI's error chunk of that type, which the client
    raises as APIError; the worker keeps serving. Reference: OpenAI's error shape and the openai client's
    exception classes. The generation fails after 2 tokens with the error the LLM makes for NaN logits."""
    import torch

    from pyllm.server.app import create_app

    fault = smol_llm._nonfinite_error(torch.full((smol_llm.n_vocab,), float("nan")))
    monkeypatch.setattr(smol_llm, "generate_tokens", failing_after(smol_llm, 2, fault))
    with served_in_thread(create_app(smol_llm, "smollm2")) as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        kw = dict(model="smollm2", max_tokens=8, temperature=0)
        for call in (lambda: c.chat.completions.create(messages=_chat("Hi"), **kw),
                     lambda: c.completions.create(prompt="Hi", **kw)):
            with pytest.raises(openai.InternalServerError) as e:
                call()
            assert e.value.body == {"message": str(fault), "type": "server_error", "param": None, "code": None}
        for call in (lambda: c.chat.completions.create(messages=_chat("Hi"), stream=True, **kw),
                     lambda: c.completions.create(prompt="Hi", stream=True, **kw)):
            got = []
            with pytest.raises(openai.APIError) as e:
                got.extend(call())
            assert e.value.body == {"message": str(fault), "type": "server_error", "param": None, "code": None}
            assert len(got) >= 2  # the tokens before the fault were streamed
        monkeypatch.undo()
        r = c.chat.completions.create(messages=_chat("Hi"), **kw)
        assert r.usage.completion_tokens == 8


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
        s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
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


def test_cors_origin_flag_adds_origins(brisk):
    for origin in ("https://ui.example", "https://a.tools.example", "http://localhost:3000"):
        status, h = _cors(brisk, "/v1/chat/completions", origin)
        assert status == 200 and h["access-control-allow-origin"] == origin, (origin, h)
    for origin in ("https://evil.example", "http://ui.example", "https://ui.example.evil"):
        status, h = _cors(brisk, "/v1/chat/completions", origin)
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
             "client": ("127.0.0.1", 50000), "headers": [(b"host", b"localhost"), (b"origin", b"http://localhost:3000")]}
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
                                     "pyllm: error: "),
                                    (["--log-format", "xml"], "--log-format", 2, "pyllm serve: error: "),
                                    (["--kv-pool-tokens", "1024"], "give --parallel > 1", 1, "pyllm: error: "),
                                    (["--port", "0", "--parallel", "2", "--ctx", "512", "--kv-pool-tokens", "100"],
                                     "cannot hold one context of 512", 1, "pyllm: error: ")):
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
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
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
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
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
    # also the server of the --cors-origin test: one server start fewer in this module
    s = Server(fixture_path("smollm2"), "--alias", "smollm2", "--ctx", "256", "--client-timeout", str(CLIENT_TIMEOUT),
               "--cors-origin", "https://ui.example/", "--cors-origin", "https://*.tools.example")
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
    heads = [b"", b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: a", b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\nGET /he"]
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
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nConnection: close\r\n"
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
