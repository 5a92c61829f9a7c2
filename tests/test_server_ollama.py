"""Ollama's API on `pyllm serve` (/api/chat, /api/generate, /api/embed, /api/tags, /api/show, /api/ps,
/api/version), driven by the official `ollama` Python client against a live server; the request log; any model
name naming the one model served.

References: the same server's OpenAI routes (the same generation, so the same greedy text and token counts, when
both meet the same prompt-cache state: the second of two identical requests), the library's embeddings, the
registry's sha256 of the file, the GGUF header, JSON schema validation (jsonschema), Ollama's documented
response fields and error shape ({"error": "..."}). Every wait is bounded. Server fixtures: conftest.py.
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import ollama  # the test extra installs it (pyproject.toml)
import pytest

from conftest import fixture_path
from server_harness import KEY, ROOT, failing_after, served_in_thread

NS_FIELDS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


def _client(server, key=KEY):
    return ollama.Client(host=server.base, headers={"Authorization": f"Bearer {key}"} if key else None,
                         timeout=300)


def _hi(text="Say hi."):
    return [{"role": "user", "content": text}]


def _check_final(r, n_generated: int):
    """Ollama's last object: done, a done_reason, the counts and the durations (ns) of a generation that ran."""
    assert r.done is True and r.done_reason in ("stop", "length")
    assert r.eval_count == n_generated and r.prompt_eval_count > 0
    assert all(getattr(r, f) >= 0 for f in NS_FIELDS) and r.prompt_eval_duration > 0 and r.eval_duration > 0
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", r.created_at)


def test_chat_is_the_openai_chat_in_ollamas_shape(smol):
    """A greedy /api/chat gives the text and token counts of /v1/chat/completions for the same request (the
    second of two identical requests each, so both meet the same cached prefix), with Ollama's fields; the
    stream's pieces join to the same text, its last object done with the counts."""
    c = _client(smol)
    opts = {"temperature": 0, "num_predict": 8}
    c.chat(model="smollm2", messages=_hi(), options=opts)
    r = c.chat(model="smollm2", messages=_hi(), options=opts)
    ref = smol.client().chat.completions.create(model="smollm2", messages=_hi(), max_tokens=8, temperature=0)
    assert r.message.role == "assistant" and r.message.content == ref.choices[0].message.content
    assert r.model == "smollm2" and r.done_reason == "length"
    assert r.prompt_eval_count == ref.usage.prompt_tokens
    _check_final(r, 8)
    parts = list(c.chat(model="smollm2", messages=_hi(), options=opts, stream=True))
    assert all(p.done is False for p in parts[:-1]) and len(parts) >= 3
    assert "".join(p.message.content for p in parts) == ref.choices[0].message.content
    _check_final(parts[-1], 8)
    # a stop string ends the reply before it
    r = c.generate(model="smollm2", prompt="1, 2, 3, 4,", raw=True, options={"temperature": 0, "stop": [","],
                                                                            "num_predict": 8, "seed": 7})
    assert r.response.strip() == "5" and r.done_reason == "stop"


def test_generate_templates_the_prompt_and_returns_its_context(smol, smol_llm):
    """/api/generate runs the prompt through the chat template (with ``system``), as Ollama does; ``context``
    holds the prompt's token ids and the reply's, and sent back it continues that conversation; raw: true sends
    the prompt as written. Reference: the library's chat_ids and tokenizer."""
    c = _client(smol)
    opts = {"temperature": 0, "num_predict": 6}
    r = c.generate(model="smollm2", prompt="Name a colour.", system="Answer briefly.", options=opts)
    turn = smol_llm.chat_ids([{"role": "system", "content": "Answer briefly."},
                              {"role": "user", "content": "Name a colour."}])
    assert r.prompt_eval_count == len(turn) and list(r.context[:len(turn)]) == turn
    assert smol_llm.detokenize(r.context[len(turn):]) == r.response and r.response
    _check_final(r, 6)
    follow = smol_llm.chat_ids([{"role": "user", "content": "Another one."}])
    r2 = c.generate(model="smollm2", prompt="Another one.", context=r.context, options=opts)
    assert r2.prompt_eval_count == len(r.context) + len(follow) and r2.response
    parts = list(c.generate(model="smollm2", prompt="The sky is", raw=True, stream=True, options=opts))
    assert parts[-1].done and parts[-1].context is None  # Ollama returns no context for a raw prompt
    assert parts[-1].prompt_eval_count == len(smol_llm.tokenize("The sky is"))
    assert "".join(p.response for p in parts) and all(not p.done for p in parts[:-1])
    # an empty prompt only loads the model, as in Ollama
    r = c.generate(model="smollm2", prompt="")
    assert r.done and r.done_reason == "load" and r.response == ""


def test_format_json_and_schema(smol):
    """format "json" constrains the reply to JSON, a schema to that schema (validated by jsonschema)."""
    c = _client(smol)
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "count"], "additionalProperties": False}
    r = c.chat(model="smollm2", messages=_hi("Is water wet? Answer in JSON."), format=schema,
               options={"temperature": 0, "num_predict": 64})
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), schema)
    r = c.generate(model="smollm2", prompt="Give a JSON object with your name.", format="json",
                   options={"temperature": 0, "num_predict": 24})
    assert r.response.lstrip().startswith("{")
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.response), dict)


def test_tool_calls_and_tool_results_in_ollamas_form(smol):
    """Tools are Ollama's (OpenAI's function tools); an earlier call (arguments an object) and its result
    (``tool_name``) are read back; a reply's calls come back with arguments as objects."""
    from pyllm.server.ollama import _chat_reply, _chat_stream, _tool_calls

    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {"city": {
                                                 "type": "string"}}, "required": ["city"]}}}
    msgs = [*_hi("Weather in Paris?"),
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                              "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"}]
    r = _client(smol).chat(model="smollm2", messages=msgs, tools=[tool], options={"temperature": 0,
                                                                                   "num_predict": 8})
    assert r.done and (r.message.content or r.message.tool_calls)
    openai_call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": "{\"city\": \"Rome\"}"}}
    assert _tool_calls([openai_call]) == [{"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]

    class Stats:
        prompt_seconds, decode_seconds = 0.5, 0.25

    class Target:
        stats = Stats()

    from pyllm.server.ollama import Timing

    timing = Timing()
    timing.start(type("Before", (), {"stats": None})())
    head = {"model": "m", "created_at": "2025-01-01T00:00:00Z"}
    reply = _chat_reply({"choices": [{"message": {"content": None, "tool_calls": [openai_call]},
                                      "finish_reason": "tool_calls", "logprobs": None}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 9}}, head, timing, Target(), False)
    assert reply["message"]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert reply["done_reason"] == "stop" and reply["eval_count"] == 9 and reply["eval_duration"] == 250_000_000

    def chunks():
        yield {"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        yield {"choices": [{"delta": {"tool_calls": [{"index": 0, **openai_call}]}, "finish_reason": None}]}
        yield {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}
        yield {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}}

    out = list(_chat_stream(chunks(), head, timing, Target()))
    assert [o["done"] for o in out] == [False, True]
    assert out[0]["message"]["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]
    assert out[1]["done_reason"] == "stop" and out[1]["prompt_eval_duration"] == 500_000_000


def test_tags_show_ps_version_describe_the_served_file(smol, smol_llm):
    from pyllm import registry

    c = _client(smol)
    path = Path(fixture_path("smollm2"))
    (m,) = c.list().models
    assert m.model == "smollm2" and m.size == path.stat().st_size
    assert m.digest == registry.sha256_file(path)
    d = m.details
    assert (d.format, d.family, d.families, d.quantization_level) == ("gguf", "llama", ["llama"], "Q4_1")
    assert d.parameter_size == "134.52M"  # as Ollama writes SmolLM2-135M's 134,515,008 parameters
    s = c.show("smollm2")
    assert s.modelinfo["llama.context_length"] == 8192 and s.modelinfo["general.architecture"] == "llama"
    assert s.modelinfo["general.parameter_count"] == 134_515_008
    assert "tokenizer.ggml.tokens" not in s.modelinfo  # the vocabulary only with verbose, as in Ollama
    assert s.template == smol_llm.template.source and "completion" in s.capabilities
    assert s.details.quantization_level == "Q4_1"
    (p,) = c.ps().models
    assert p.context_length == 512 and p.size > m.size and p.size_vram == 0
    status, body = smol.raw("/api/version", key=None)
    assert status == 401  # the API key guards /api as it guards /v1
    status, body = smol.raw("/api/version")
    assert status == 200 and re.fullmatch(r"\d+\.\d+\.\d+", body["version"])


def test_embed_matches_the_library(smol, smol_llm):
    """Reference: the library's embeddings of the same texts (L2-normalised, as Ollama's /api/embed)."""
    import numpy as np

    r = _client(smol).embed(model="smollm2", input=["red apple", "blue sky"])
    ref = smol_llm.embed(["red apple", "blue sky"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == smol_llm.config.n_embd
    np.testing.assert_allclose(np.array(r.embeddings), np.array(ref), atol=1e-5)
    assert r.prompt_eval_count == sum(len(smol_llm.tokenize(t)) for t in ("red apple", "blue sky"))
    assert _client(smol).embed(model="smollm2", input=[]).embeddings == []
    # the deprecated /api/embeddings: one vector, not normalised (as Ollama serves it there)
    old = _client(smol).embeddings(model="smollm2", prompt="red apple").embedding
    np.testing.assert_allclose(np.array(old), np.array(smol_llm.embed("red apple", normalize=False)), atol=1e-4)


@pytest.mark.parametrize("call, message", [
    (lambda c: c.chat(model="smollm2", messages=_hi(), options={"mirostat": 2}), "mirostat"),
    (lambda c: c.chat(model="smollm2", messages=_hi(), options={"nonsense": 1}), "unknown option 'nonsense'"),
    (lambda c: c.chat(model="smollm2", messages=_hi(), options={"temperature": -1}), "temperature must be"),
    (lambda c: c.chat(model="smollm2", messages=_hi(), options={"num_predict": -3}), "num_predict"),
    (lambda c: c.chat(model="smollm2", messages=_hi(), think=True), "does not support thinking"),
    (lambda c: c.chat(model="smollm2", messages=_hi(), keep_alive="soon"), "keep_alive"),
    (lambda c: c.generate(model="smollm2", prompt="hi", images=[b"\x89PNG"]), "images are not supported"),
    (lambda c: c.generate(model="smollm2", prompt="word " * 700), "context holds 512"),
    (lambda c: c.embed(model="smollm2", input=["a"], dimensions=3), "dimensions"),
    (lambda c: c.chat(model="smollm2", messages=[{"role": "wizard", "content": "x"}]), "role"),
])
def test_bad_requests_are_ollama_errors(smol, call, message):
    with pytest.raises(ollama.ResponseError) as e:
        call(_client(smol))
    assert e.value.status_code == 400 and message in e.value.error


def test_errors_on_api_routes_are_ollamas_shape(smol):
    """{"error": "message"} whatever layer refuses: the route, the JSON parser, the key check, an unknown route."""
    for path, body, key, status in (("/api/chat", b'{"messages": [', KEY, 400),
                                    ("/api/chat", json.dumps({"messages": _hi(), "format": "xml"}).encode(), KEY,
                                     400),
                                    ("/api/ps", None, "sk-wrong", 401), ("/api/pull", b"{}", KEY, 404)):
        got, out = smol.raw(path, body, key=key)
        assert got == status and set(out) == {"error"} and isinstance(out["error"], str), (path, out)
    with pytest.raises(ollama.ResponseError) as e:
        _client(smol, key="sk-wrong").chat(model="smollm2", messages=_hi())
    assert e.value.status_code == 401 and "API key" in e.value.error


def test_any_model_name_is_the_served_model(smol):
    """One model is served, so every name names it, as llama-server answers: the README's "smollm2-135m" on a
    server started on a file (alias smollm2 here) was a 404. Ollama's responses carry the name asked for."""
    r = _client(smol).chat(model="llama3.2:latest", messages=_hi(), options={"num_predict": 2})
    assert r.model == "llama3.2:latest" and r.eval_count == 2
    ref = smol.client().chat.completions.create(model="smollm2-135m", messages=_hi(), max_tokens=2)
    assert ref.model == "smollm2" and ref.usage.completion_tokens == 2
    assert smol.client().models.retrieve("gpt-9/x").id == "smollm2"
    assert _client(smol).show("anything").details.family == "llama"


def test_the_server_logs_one_line_per_request(smol):
    """Text lines: method, path, status, prompt and generated tokens, milliseconds; /health is not logged."""
    _client(smol).generate(model="smollm2", prompt="Hello", options={"num_predict": 3})
    smol.raw("/v1/nothing", b"{}")
    deadline = time.monotonic() + 30  # a line is written once its response has gone: the client may read first
    while " /v1/nothing " not in smol.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    out = smol.output()
    m = re.findall(r"^\S+Z 127\.0\.0\.1 POST /api/generate 200 prompt=(\d+) generated=3 (\d+) ms$", out, re.M)
    assert m and int(m[-1][0]) > 0
    assert re.search(r"^\S+Z 127\.0\.0\.1 POST /v1/nothing 404 prompt=- generated=- \d+ ms$", out, re.M)
    assert not re.search(r" GET /health ", out)


def test_json_log_and_a_stream_that_fails_midway(smol_llm, monkeypatch, capsys):
    """--log-format json: one JSON object a line. A generation that fails after two tokens ends an NDJSON stream
    with Ollama's {"error": ...} line (the ollama client raises it), and the log names the tokens generated."""
    import torch

    from pyllm.server.app import create_app

    fault = smol_llm._nonfinite_error(torch.full((smol_llm.n_vocab,), float("nan")))
    monkeypatch.setattr(smol_llm, "generate_tokens", failing_after(smol_llm, 2, fault))
    with served_in_thread(create_app(smol_llm, "smollm2", log_format="json")) as base:
        c = ollama.Client(host=base, timeout=120)
        got = []
        with pytest.raises(ollama.ResponseError) as e:
            for part in c.chat(model="smollm2", messages=_hi(), stream=True, options={"temperature": 0}):
                got.append(part)
        assert str(fault) in e.value.error and got and not any(p.done for p in got)
        with pytest.raises(ollama.ResponseError) as e:
            c.generate(model="smollm2", prompt="Hi", options={"temperature": 0})
        assert e.value.status_code == 500 and str(fault) in e.value.error
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    assert [(x["method"], x["path"], x["status"]) for x in lines] == [("POST", "/api/chat", 200),
                                                                     ("POST", "/api/generate", 500)]
    # the third token is the one the failure came with
    assert lines[0]["generated_tokens"] in (2, 3) and lines[0]["prompt_tokens"] > 0 and lines[0]["ms"] > 0


def test_request_log_escapes_what_a_client_writes():
    from pyllm.server.request_log import format_line

    line = format_line("text", "GET", "/x\n2026-01-01T00:00:00Z 1.2.3.4 GET /forged 200", 404, None, 1.0, "::1")
    assert "\n" not in line and "/x\\n2026" in line
    assert json.loads(format_line("json", "GET", "/a", 200, (3, 4), 2.5, None))["generated_tokens"] == 4


def _readme_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Serve")
    return text[start:text.index("\n## ", start + 1)]


def test_readme_ollama_examples_run_against_a_live_server(smol):
    sec = _readme_section()
    curl = re.search(r"```bash\n(curl \S+/api/chat .*?)\n```", sec, re.S).group(1)
    py = re.search(r"```python\n(import ollama\n.*?)\n```", sec, re.S).group(1)
    fix = lambda s: (s.replace("8080", str(smol.port)).replace("smollm2-135m", "smollm2")  # noqa: E731
                     .replace("Client(host=", f"Client(headers={{'Authorization': 'Bearer {KEY}'}}, host="))
    out = subprocess.run(["bash", "-c", fix(curl).replace("curl ", f"curl -sS -H 'Authorization: Bearer {KEY}' ", 1)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert lines[-1]["done"] is True and "".join(x["message"]["content"] for x in lines)
    out = subprocess.run([sys.executable, "-c", fix(py)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
