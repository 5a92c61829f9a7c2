"""`pyllm serve`'s POST /v1/chat/completions driven by the official openai client over 127.0.0.1: text and
stream, sampling and logprobs, parameter checks, structured output, tools (SmolLM2, and Qwen2.5 whose template
renders tool calls).

References: the library's own greedy generation (the server must return the same text), OpenAI's documented stream
and error shapes, pydantic and jsonschema for structured output. Server fixtures: conftest.py.
"""

import concurrent.futures
import json
import re

import openai
import pytest

from server_harness import _chat, _ok


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


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


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
