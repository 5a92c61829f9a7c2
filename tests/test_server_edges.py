"""`pyllm serve` at its edges: every JSON a request carries is parsed within bounds (a client's mistake is a 400,
never a 500), a reply that is not a valid tool call comes back as text, who may call the server (API key, Host
header), and how much memory requests in flight may hold.

References: OpenAI's error shape and the openai client's exception classes; Ollama's DNS-rebinding defence and
llama-server's open paths for the access rules; /proc/PID/status (VmHWM, the peak resident set, reset through
/proc/PID/clear_refs) for memory; the server's /metrics gauge of request memory. Every wait is bounded.
"""

import concurrent.futures
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

from server_harness import KEY, ROOT, Server, _chat, _ok, served_in_thread

# ------------------------------------------------------------------------------ a sweep of hostile JSON, every slot
# Raw JSON text put where a value goes: nesting past every limit (and past Python's recursion), numbers past a
# double and past Python's 4300 digits, and bytes that are not UTF-8 (invalid, overlong, a UTF-8-encoded surrogate,
# cut short), and an escaped lone surrogate.
HOSTILE = {
    "deep array": b"[" * 5000 + b"]" * 5000,
    "deep object": b'{"a":' * 3000 + b"1" + b"}" * 3000,
    "just too deep": b"[" * 65 + b"]" * 65,
    "huge integer": b"9" * 5000,
    "integer past a double": b"-1" + b"0" * 400,
    "float past a double": b"1e400",
    "float under a double": b"1e-400",
    "long fraction": b"0." + b"1" * 5000,
    "not UTF-8": b'"\xff\xfe"',
    "overlong UTF-8": b'"\xc0\xaf"',
    "UTF-8 surrogate": b'"\xed\xa0\x80"',
    "cut UTF-8": b'"\xe2\x82"',
    "lone surrogate escape": b'"\\udc00"',
}
# The same as JSON text inside a string, where the API takes JSON text (a tool call's arguments)
HOSTILE_TEXT = {name: json.dumps(raw.decode("utf-8", "surrogateescape"), ensure_ascii=True).encode()
                for name, raw in HOSTILE.items() if raw[:1] != b'"'}
HOSTILE_TEXT["NaN text"] = b'"{\\"a\\": NaN}"'
HOSTILE_TEXT["surrogate in text"] = b'"{\\"a\\": \\"\\\\ud800\\"}"'

U = b'{"role": "user", "content": "Hi"}'
CALL = b'{"id": "c1", "type": "function", "function": {"name": "f", "arguments": @}}'
TOOL = b'{"type": "function", "function": {"name": "f", "parameters": @}}'
# (route, body with @ where the hostile value goes); max_tokens 1 keeps what is accepted quick
SLOTS = [("/v1/chat/completions", b'{"messages": [' + m + b'], "max_tokens": 1}') for m in (
    b'{"role": "user", "content": @}',
    b'{"role": "user", "content": [{"type": "text", "text": @}]}',
    U + b', {"role": "assistant", "content": null, "tool_calls": [' + CALL + b']}, '
        b'{"role": "tool", "tool_call_id": "c1", "content": "ok"}',
    U + b', {"role": "assistant", "content": null, "function_call": {"name": "f", "arguments": @}}',
    U + b', {"role": "tool", "tool_call_id": @, "content": "ok"}',
    b'{"role": @, "content": "Hi"}')] + [
    ("/v1/chat/completions", b'{"messages": [' + U + b'], "max_tokens": 1, ' + p + b"}") for p in (
        b'"temperature": @', b'"top_p": @', b'"top_k": @', b'"min_p": @', b'"seed": @', b'"n": @',
        b'"max_completion_tokens": @', b'"max_tokens": @, "stream": true', b'"logit_bias": {"5": @}',
        b'"logit_bias": {@: 1}', b'"stop": [@]', b'"tools": [' + TOOL + b"]",
        b'"tools": [' + TOOL.replace(b"@", b"{}") + b'], "tool_choice": @',
        b'"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": @}}',
        b'"logprobs": true, "top_logprobs": @', b'"stream": true, "stream_options": {"include_usage": @}',
        b'"metadata": {"k": @}', b'"user": @', b'"unknown_parameter": @', b'"model": @')] + [
    ("/v1/completions", b'{"prompt": "Hi", "max_tokens": 1, ' + p + b"}") for p in (
        b'"prompt": @', b'"prompt": [1, @]', b'"logprobs": @', b'"echo": @', b'"suffix": @', b'"best_of": @',
        b'"temperature": @', b'"seed": @', b'"stop": @')] + [
    ("/v1/responses", b'{"max_output_tokens": 1, ' + p + b"}") for p in (
        b'"input": @', b'"input": [{"role": "user", "content": @}]',
        b'"input": [{"role": "user", "content": [{"type": "input_text", "text": @}]}]',
        b'"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": @}, '
        b'{"type": "function_call_output", "call_id": "c", "output": "ok"}]',
        b'"input": [{"type": "function_call_output", "call_id": "c", "output": @}]',
        b'"input": "Hi", "metadata": {"k": @}', b'"input": "Hi", "metadata": {"k": @}, "stream": true',
        b'"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": @}]',
        b'"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": @}}',
        b'"input": "Hi", "instructions": @', b'"input": "Hi", "temperature": @', b'"input": "Hi", "user": @',
        b'"input": "Hi", "max_output_tokens": @', b'"input": "Hi", "reasoning": @')] + [
    ("/v1/embeddings", b"{" + p + b"}") for p in (
        b'"input": @', b'"input": [@]', b'"input": "Hi", "dimensions": @',
        b'"input": "Hi", "encoding_format": @')]


def _post(port: int, path: str, body: bytes, headers: dict | None = None, timeout: float = 300):
    """(status, headers, body text) of one POST, made byte for byte (no client re-encodes the body)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                     "Authorization": f"Bearer {KEY}", **(headers or {})})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode("utf-8", "replace")
    finally:
        c.close()


def test_hostile_json_in_every_slot_is_a_400_or_an_answer_never_a_500(smol):
    """Each hostile value in each slot of each route (the body, a parameter, a message's content, a tool call's
    arguments as JSON and as JSON text, Responses input items, schemas, unknown parameters), raw HTTP: the reply is
    a 2xx or a 4xx with an OpenAI error object naming the problem; never a 5xx or an internal error mid-stream.
    Today's failures this sweep found: a tool call's arguments in the history nested past Python's recursion or
    holding an integer past 4300 digits (a 500 "RecursionError" / "ValueError"), on the chat and Responses routes."""
    bad = []
    for path, template in SLOTS:
        values = {**HOSTILE, **HOSTILE_TEXT} if b'"arguments": @' in template else HOSTILE
        for name, value in values.items():
            status, _, text = _post(smol.port, path, template.replace(b"@", value))
            if status >= 500 or "internal error" in text or "server_error" in text:
                bad.append((path, template[:90], name, status, text[:200]))
            elif status >= 400:
                err = json.loads(text)["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"], (path, name, text)
                assert len(err["message"]) < 1000, (path, name, err["message"][:200])
            else:
                assert status == 200, (path, name, status, text[:200])
    assert not bad, "\n".join(map(str, bad))
    _ok(smol)


def test_history_arguments_past_the_bounds_are_400s_naming_where(smol):
    """A tool call's arguments (JSON text) in a conversation go through the body's parser: past its bounds, a 400
    naming the message, the call and the parameter as the route spells it (messages / input); text that is not
    JSON at all stays text, as OpenAI takes any string there."""
    deep = json.dumps("[" * 5000 + "]" * 5000)
    body = {"messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "@"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "max_tokens": 1}
    raw = json.dumps(body).encode().replace(b'"@"', deep.encode())
    status, _, text = _post(smol.port, "/v1/chat/completions", raw)
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == "messages", text
    assert "messages[1].tool_calls[0].function.arguments" in err["message"] and "nest too deeply" in err["message"]
    items = [{"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a": ' + "9" * 5000 + "}"},
             {"type": "function_call_output", "call_id": "c", "output": "ok"}]
    status, _, text = _post(smol.port, "/v1/responses", json.dumps({"input": items, "max_output_tokens": 1}).encode())
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == "input" and "input[0].arguments" in err["message"], text
    assert "4300 digits" in err["message"] and "sys." not in err["message"]
    body["messages"][1]["tool_calls"][0]["function"]["arguments"] = "not json {"
    status, _, text = _post(smol.port, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, text


# --------------------------------------------------------------------- a reply that is not a valid tool call is text
def _replying(llm, text: str):
    """A stand-in for ``llm.generate_tokens`` whose reply is ``text`` (then the end of the turn), whatever the
    prompt: the model writing a call no parser should take."""
    ids = llm.tokenizer.encode(text, add_bos=False, special=False)

    def generate_tokens(*args, **kwargs):
        yield from ids
        yield llm.tokenizer.eos_id

    return generate_tokens


BROKEN_CALLS = {
    "too deep": '<tool_call>\n{"name": "get_weather", "arguments": {"a": ' + "[" * 3000 + "]" * 3000 + "}}\n</tool_call>",
    "too long a number": '<tool_call>\n{"name": "get_weather", "arguments": {"a": ' + "7" * 5000 + "}}\n</tool_call>",
    "NaN": '<tool_call>\n{"name": "get_weather", "arguments": {"a": NaN}}\n</tool_call>',
    "bare and too deep": '{"name": "get_weather", "arguments": ' + '{"a": ' * 2000 + "1" + "}" * 2001,
}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("case", BROKEN_CALLS)
def test_a_reply_that_does_not_parse_as_a_tool_call_comes_back_as_text(smol_llm, monkeypatch, case):
    """A call the model writes that no bounded parser takes (nested past Python's recursion, a number past its
    4300 digits, NaN, which is not JSON) was a 500 (RecursionError, ValueError) and the generated reply was lost,
    or with NaN a tool call whose arguments no client can parse. Reference: vLLM's tool parsers, which return such
    a reply as plain content: here the whole text, finish_reason "stop" (as for any text), no tool_calls; streamed,
    the deltas join to the same text; on /v1/responses, one message item of that text."""
    from pyllm.server.app import create_app

    text = BROKEN_CALLS[case]
    monkeypatch.setattr(smol_llm, "generate_tokens", _replying(smol_llm, text))
    with served_in_thread(create_app(smol_llm, "s")) as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        kw = dict(model="s", messages=_chat("Weather in Paris?"), tools=WEATHER, max_tokens=8000)
        r = c.chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.message.content == text and not choice.message.tool_calls
        assert choice.finish_reason == "stop"
        deltas, finish = [], None
        for chunk in c.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                assert not ch.delta.tool_calls
                deltas.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
        assert "".join(deltas) == text and finish == "stop"
        resp = c.responses.create(model="s", input="Weather in Paris?", tools=[
            {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}], max_output_tokens=8000)
        assert [o.type for o in resp.output] == ["message"] and resp.output_text == text


# ------------------------------------------------------------------------------------------------ access control
def _get(port: int, path: str, host: str | None = None, key: str | None = None):
    """(status, body text) of a GET with the Host header ``host`` (default: 127.0.0.1:port, as clients send)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        c.putrequest("GET", path, skip_host=True)
        c.putheader("Host", host if host is not None else f"127.0.0.1:{port}")
        if key:
            c.putheader("Authorization", f"Bearer {key}")
        c.endheaders()
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def test_with_an_api_key_only_health_and_the_model_list_are_open(smol):
    """llama-server's rule: with --api-key, /health and the model list answer without the key; /metrics (which
    tells request counts and timing) and every other path, one no route serves included, need it."""
    for path in ("/health", "/v1/models"):
        assert _get(smol.port, path)[0] == 200, path
    for path in ("/metrics", "/v1/models/smollm2", "/v1/anything", "/api/anything", "/docs"):
        status, text = _get(smol.port, path)
        error = json.loads(text)["error"]  # Ollama's shape on /api: the message alone
        assert status == 401 and ("API key" in error if path.startswith("/api/") else
                                  error["code"] == "invalid_api_key"), (path, text)
    assert _get(smol.port, "/metrics", key=KEY)[0] == 200
    assert _get(smol.port, "/v1/anything", key=KEY)[0] == 404


LOCAL_HOSTS = ["localhost", "LOCALHOST:8080", "127.0.0.1", "127.9.8.7:1", "[::1]:8080", "[::1]", "10.1.2.3",
               "192.168.0.5:11434", "172.16.0.1", "0.0.0.0", "app.localhost", "a.b.localhost:8080", "localhost.",
               socket.gethostname()]
FOREIGN_HOSTS = ["evil.example", "evil.example:8080", "localhost.evil.example", "127.0.0.1.nip.io", "8.8.8.8",
                 "[2606:4700::1111]:80", "example.com.", "corp.test"]


def test_host_header_outside_this_machine_is_403_when_bound_to_loopback(smol):
    """Ollama's DNS-rebinding defence: a page on evil.example whose DNS name the attacker re-points at 127.0.0.1
    reaches a loopback server as same-origin, so CORS does not stop it; its requests carry Host: evil.example. A
    loopback server answers only Host names of this machine (localhost and *.localhost, loopback and private
    addresses, the machine's name); others are a 403 on every path, /health and the open ones too."""
    for host in LOCAL_HOSTS:
        assert _get(smol.port, "/health", host)[0] == 200, host
    for host in FOREIGN_HOSTS:
        for path in ("/health", "/v1/models", "/metrics"):
            status, text = _get(smol.port, path, host, key=KEY)
            assert status == 403, (host, path, status)
            err = json.loads(text)["error"]
            assert err["code"] == "host_not_allowed" and "--allow-host" in err["message"], text
    status, _, text = _post(smol.port, "/v1/chat/completions",
                            json.dumps({"messages": _chat("Hi"), "max_tokens": 1}).encode(),
                            headers={"Host": "evil.example"})
    assert status == 403, text


def test_host_check_is_off_when_not_bound_to_loopback(smol_llm):
    """Bound to all addresses (or any address other than loopback), clients reach the server by names this machine
    cannot know, as Ollama allows; the check applies to loopback only. create_app's host decides it."""
    from pyllm.server.app import create_app

    with served_in_thread(create_app(smol_llm, "s", host="0.0.0.0")) as base:
        assert _get(int(base.rsplit(":", 1)[1]), "/health", "evil.example")[0] == 200
    with served_in_thread(create_app(smol_llm, "s", host="localhost")) as base:
        assert _get(int(base.rsplit(":", 1)[1]), "/health", "evil.example")[0] == 403


# -------------------------------------------------------------------------------- memory bounded by admission
MAX_BODY = 1 << 18
BUDGET_MIB = 96


@pytest.fixture(scope="module")
def tight():
    """A server with a small body limit and request-memory budget, and two more Host names allowed."""
    from conftest import fixture_path

    s = Server(fixture_path("smollm2"), "--alias", "smollm2", "--ctx", "512", "--max-body", str(MAX_BODY),
               "--max-request-memory", str(BUDGET_MIB), "--allow-host", "evil.example", "--allow-host", "*.corp.test")
    yield s
    s.close()


def test_allow_host_adds_names(tight):
    for host in ("evil.example", "EVIL.example:8080", "a.corp.test", "b.a.corp.test"):
        assert _get(tight.port, "/health", host)[0] == 200, host
    for host in ("corp.test", "notevil.example", "evil.example.org"):
        assert _get(tight.port, "/health", host)[0] == 403, host


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_requests_past_the_memory_budget_are_503s_and_the_server_stays_within_its_bound(tight):
    """32 clients each send a body at --max-body whose metadata (echoed by /v1/responses) parses into ~28,000
    small objects (7 MiB of Python objects from 256 KiB of text) while the model is busy with a long request, so
    every accepted body waits parsed in the queue: the server held them all (+239 MiB peak RSS), and /health
    waited while bodies were parsed on the event loop. With admission, bodies are counted from their Content-Length and their parse's estimated size (an
    upper bound: tests/test_request_json.py) against --max-request-memory; those past it are 503 with Retry-After
    (TGI's answer past its concurrency limit), /health answers throughout (parsing runs off the event loop), and
    the peak resident set grows by at most the budget, the scan of the body being parsed (3 x --max-body) and 32 MiB
    for the connections and the model's work. Reference: VmHWM in /proc/PID/status, reset before the load through
    /proc/PID/clear_refs; the queue-depth gauge tells when every body is answered or waiting."""
    pid = tight.proc.pid
    pad = b'{"a":[]},' * ((MAX_BODY - 200) // 9)
    # in metadata, which /v1/responses echoes: the parsed body is held until the reply is made
    body = b'{"input": "Hi", "max_output_tokens": 1, "metadata": {"pad": [' + pad + b"1]}}"
    assert len(body) <= MAX_BODY
    # the worker embeds 20,000 texts (minutes) until this connection closes: what is accepted meanwhile waits
    busy = socket.create_connection(("127.0.0.1", tight.port), timeout=60)
    long_job = json.dumps({"input": ["hi"] * 20000}).encode()
    busy.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(long_job)).encode() + b"\r\n\r\n" + long_job)
    deadline = time.monotonic() + 120
    while tight.metrics()["pyllm_requests_processing"] == 0:
        assert time.monotonic() < deadline, "the server did not start on the long request within 120 s"
        time.sleep(0.1)
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from the current one
    before = _status_kib(pid, "VmHWM")
    health = []

    def check_health(stop: threading.Event):
        while not stop.is_set():
            health.append(_get(tight.port, "/health")[0])
            stop.wait(0.2)

    stop = threading.Event()
    watcher = threading.Thread(target=check_health, args=(stop,))
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(_post, tight.port, "/v1/responses", body) for _ in range(32)]
            deadline = time.monotonic() + 300
            while sum(f.done() for f in futures) + tight.metrics()["pyllm_queue_depth"] < 32:
                assert time.monotonic() < deadline, "the bodies were neither answered nor queued within 300 s"
                time.sleep(0.2)
            grew_mib = (_status_kib(pid, "VmHWM") - before) / 1024
            busy.close()  # the long request is cancelled; the admitted ones run
            replies = [f.result() for f in futures]
    finally:
        busy.close()
        stop.set()
        watcher.join(timeout=120)
    statuses = sorted(s for s, _, _ in replies)
    assert set(statuses) <= {200, 503} and 503 in statuses and 200 in statuses, statuses
    for status, headers, text in replies:
        if status == 503:
            assert headers.get("retry-after") == "1" and json.loads(text)["error"]["code"] == "server_overloaded"
    assert health and set(health) == {200}, health
    assert grew_mib <= BUDGET_MIB + 3 * MAX_BODY / 2**20 + 32, (grew_mib, statuses)
    deadline = time.monotonic() + 60
    while tight.metrics()["pyllm_request_memory_bytes"] != 0:  # every request's hold is given back
        assert time.monotonic() < deadline, tight.metrics()["pyllm_request_memory_bytes"]
        time.sleep(0.2)
    _ok(tight)


def test_request_memory_below_one_request_is_refused_before_loading():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for args, msg in ((["--max-request-memory", "16"], "--max-request-memory 16 MiB is less than one request"),
                      (["--allow-host", "evil.example/x"], "--allow-host 'evil.example/x' is not a host name")):
        r = subprocess.run([sys.executable, "-m", "pyllm.cli.main", "serve", "no-such-model-file.gguf", *args],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and r.stderr.startswith("pyllm: error: ") and msg in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
