"""POST /v1/responses (OpenAI's Responses API, stateless) driven by the official openai client over 127.0.0.1.

References: the same server's /v1/chat/completions for the same conversation at temperature 0 (the Responses
route translates into it, so the text must be equal), the openai package's own response and stream-event types
and its stream accumulator (responses.stream's get_final_response, responses.parse's output_parsed).
"""

import json

import openai
import pytest

from server_harness import _chat, failing_after, served_in_thread


def _chat_text(server, messages, n):
    r = server.client().chat.completions.create(model="smollm2", messages=messages, max_tokens=n, temperature=0)
    return r.choices[0]


def test_create_matches_chat(smol):
    """A string input is one user message; instructions are a system message first; input_text parts are the
    message's text. Reference: the chat endpoint's greedy text and finish_reason (length: status incomplete,
    reason max_output_tokens)."""
    c = smol.client()
    r = c.responses.create(model="smollm2", input="Name a color.", max_output_tokens=12, temperature=0)
    want = _chat_text(smol, _chat("Name a color."), 12)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "smollm2"
    msg = r.output[0]
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.role == "assistant"
    assert msg.content[0].type == "output_text" and msg.content[0].text == want.message.content
    assert r.status == ("incomplete" if want.finish_reason == "length" else "completed")
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens

    items = [{"role": "user", "content": [{"type": "input_text", "text": "Say "}, {"type": "input_text",
                                                                                  "text": "one word."}]}]
    r = c.responses.create(model="smollm2", instructions="You are terse.", input=items, max_output_tokens=3,
                           temperature=0)
    want = _chat_text(smol, [{"role": "system", "content": "You are terse."}, *_chat("Say one word.")], 3)
    assert r.output[0].content[0].text == want.message.content and want.finish_reason == "length"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_stream_deltas_make_the_final_response(smol):
    """responses.stream: the deltas, in order, are the final text, which equals the non-streamed answer;
    sequence numbers increase by one; get_final_response (the client's accumulator, which takes only
    response.completed: the reply must end before the limit) works. A reply cut at the limit ends in
    response.incomplete."""
    c = smol.client()
    kw = dict(model="smollm2", input="Say hi.", max_output_tokens=32, temperature=0)
    want = c.responses.create(**kw)
    assert want.status == "completed"
    with c.responses.stream(**kw) as st:
        events = list(st)
        final = st.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    text = want.output[0].content[0].text
    assert len(deltas) > 1 and "".join(deltas) == text == final.output[0].content[0].text
    assert final.usage.output_tokens == want.usage.output_tokens and final.id == events[0].response.id
    with c.responses.stream(**{**kw, "max_output_tokens": 2}) as st:
        last = list(st)[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"


def test_parse_with_a_pydantic_model(smol):
    """responses.parse(text_format=Model) sends text.format json_schema; the reply must validate (pydantic is
    the reference)."""
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        population: int

    r = smol.client().responses.parse(model="smollm2", input="Give an example City as JSON.", text_format=City,
                                      temperature=0, max_output_tokens=48)
    assert r.status == "completed" and isinstance(r.output_parsed, City), r


def test_function_call_and_its_output(smol):
    """tool_choice required forces a call (constrained to the tool's schema, as on the chat endpoint): a
    function_call item whose arguments parse as JSON; sending it back with a function_call_output is a tool
    turn the model answers."""
    tool = {"type": "function", "name": "get_weather", "description": "Weather in a city", "strict": True,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                           "additionalProperties": False}}
    c = smol.client()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.responses.create(model="smollm2", input=ask, tools=[tool], tool_choice="required", temperature=0,
                           max_output_tokens=32)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and calls[0].name == "get_weather" and calls[0].id.startswith("fc_")
    assert isinstance(json.loads(calls[0].arguments), dict)
    back = ask + [calls[0].model_dump(exclude_none=True),
                  {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "sunny"}'}]
    r2 = c.responses.create(model="smollm2", input=back, tools=[tool], temperature=0, max_output_tokens=8)
    assert r2.output and r2.usage.input_tokens > r.usage.input_tokens  # the call and its result are in the prompt


def test_what_needs_storage_or_hosted_tools_is_a_400(smol):
    """Reference: OpenAI's error shape, param naming the refused parameter; unknown keys are ignored, as on the
    chat endpoint; the route is counted in /metrics."""
    c = smol.client()
    for kw, param in ((dict(previous_response_id="resp_1"), "previous_response_id"),
                      (dict(tools=[{"type": "web_search"}]), "tools"),
                      (dict(background=True), "background"),
                      (dict(reasoning={"effort": "high"}), "reasoning"),
                      (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                       "input")):
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(**{"model": "smollm2", "input": "Hi", "max_output_tokens": 2, **kw})
        assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error", e.value.body
    r = c.responses.create(model="smollm2", input="Hi", max_output_tokens=1, extra_body={"no_such_key": 1})
    assert r.usage.output_tokens == 1
    _, text = smol.raw("/metrics")
    assert 'pyllm_requests_total{route="/v1/responses",status="400"} 5' in text
    assert 'pyllm_requests_total{route="/v1/responses",status="200"}' in text


def test_stream_events_for_text_then_several_calls():
    """The chat stream's chunks for a reply with text and then two tool calls (parallel calls: the model is not
    asked, the chunks are written here) as Responses events. Reference: the openai package's event types, each
    event parsed by them, and its stream accumulator's order: the message item closes once, before the first
    call, and each call is its own item (the second call re-closed the message and raised TypeError)."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from pyllm.server.responses import _events

    base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "smollm2"}

    def chunks():
        yield {**base, "choices": [{"index": 0, "delta": {"content": "Calling."}, "finish_reason": None}]}
        for i in (1, 2):
            call = {"index": i - 1, "id": f"call_{i}", "type": "function",
                    "function": {"name": "f", "arguments": json.dumps({"i": i})}}
            yield {**base, "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}
        yield {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
               "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12,
                         "prompt_tokens_details": {"cached_tokens": 0}}}

    head = {"id": "resp_x", "object": "response", "created_at": 0, "status": "in_progress", "model": "smollm2",
            "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
    events = list(_events(chunks(), head))
    adapter = TypeAdapter(ResponseStreamEvent)
    for e in events:
        adapter.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [d["type"] for d in done] == ["message", "function_call", "function_call"]
    assert done[0]["content"][0]["text"] == "Calling."
    assert [(d["call_id"], json.loads(d["arguments"])) for d in done[1:]] == [("call_1", {"i": 1}), ("call_2", {"i": 2})]
    final = events[-1]
    assert final["type"] == "response.completed" and [o["type"] for o in final["response"]["output"]] == \
        ["message", "function_call", "function_call"]
    assert final["response"]["usage"]["total_tokens"] == 12


def test_a_generation_that_fails_mid_stream_ends_in_openais_error_event(smol_llm, monkeypatch):
    """A generation that fails after its first tokens ends the stream with the Responses API's error event, which
    the openai client yields as ResponseErrorEvent: the error's message, its kind as the code (server_error: the
    model, not the request, is at fault; the code was null) and the next sequence number, after the usual events
    for the text so far. Reference: the openai package's event types, validated field by field."""
    import torch
    from openai.types.responses import ResponseErrorEvent, ResponseTextDeltaEvent

    from pyllm.server.app import create_app

    fault = smol_llm._nonfinite_error(torch.full((smol_llm.n_vocab,), float("nan")))
    monkeypatch.setattr(smol_llm, "generate_tokens", failing_after(smol_llm, 3, fault))
    with served_in_thread(create_app(smol_llm, "smollm2")) as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        events = list(c.responses.create(model="smollm2", input="Tell a story.", max_output_tokens=16,
                                         temperature=0, stream=True))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added"]
    assert all(isinstance(e, ResponseTextDeltaEvent) for e in events[4:-1]) and len(events) > 5
    err = events[-1]
    assert isinstance(err, ResponseErrorEvent)
    assert ResponseErrorEvent.model_validate(err.model_dump(), strict=True) == err
    assert (err.message, err.code, err.param) == (str(fault), "server_error", None)
    assert [e.sequence_number for e in events] == list(range(len(events)))
