"""OpenAI's Responses API (POST /v1/responses) over create_chat_completion, stateless.

A Responses request is translated into chat-completion keyword arguments (``translate``) and the chat result back
into a ``response`` object, or the chat stream's chunks into Responses' named events, so sampling, stop handling,
tool calls and structured output stay the chat endpoint's. Nothing is stored: a request carries its whole
conversation in ``input``, and what needs a stored response or conversation (previous_response_id, conversation,
background) is refused naming the parameter, as are hosted tools and non-text inputs.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Callable, Iterator

from ..api import SAMPLING_DEFAULTS
from ..chat_messages import history_arguments
from ..errors import BadRequest

# Chat parameters that errors from create_chat_completion name, as this request spells them.
PARAMS = {"messages": "input", "response_format": "text", "json_schema": "text",
          "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}
# llama-server's sampler extras, taken on this route as on the chat one (the Responses API has none of them).
SAMPLER_EXTRAS = ("top_k", "min_p", "typical_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
                  "logit_bias", "seed", "stop")
STATELESS = "this server stores no responses: send the whole conversation in input"


def _hex() -> str:
    return uuid.uuid4().hex


def _refuse_unsupported(data: dict) -> None:
    for param in ("previous_response_id", "conversation"):
        if data.get(param) is not None:
            raise BadRequest(f"{param} is not supported: {STATELESS}", param)
    if data.get("background"):
        raise BadRequest("background responses are not supported: they are stored to be polled, and "
                         f"{STATELESS}", "background")
    if data.get("prompt") is not None:
        raise BadRequest("prompt templates (prompt) are not supported: send the text in instructions and input",
                         "prompt")
    reasoning = data.get("reasoning")
    if reasoning is not None and not (isinstance(reasoning, dict) and reasoning.get("effort") in (None, "none")
                                      and all(v is None for k, v in reasoning.items() if k != "effort")):
        raise BadRequest(f"reasoning={reasoning!r:.80} is not supported: the model is served without reasoning "
                         f"settings (null or {{\"effort\": \"none\"}})", "reasoning")
    if data.get("truncation") not in (None, "disabled"):
        raise BadRequest("truncation \"auto\" is not supported: a conversation that does not fit is refused "
                         "(\"disabled\")", "truncation")
    if data.get("metadata") is not None and not isinstance(data["metadata"], dict):
        raise BadRequest("metadata must be an object of string keys and values", "metadata")
    include = data.get("include") or []
    if data.get("top_logprobs") or (isinstance(include, list) and "message.output_text.logprobs" in include):
        raise BadRequest("logprobs are not supported on /v1/responses (use /v1/chat/completions)", "top_logprobs")


def _text(content, where: str) -> str | list[dict]:
    """A message's content (a string or Responses content parts) as chat content."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of content parts", "input")
    parts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif kind == "refusal" and isinstance(p.get("refusal"), str):
            parts.append({"type": "refusal", "refusal": p["refusal"]})
        else:
            raise BadRequest(f"{where}.content[{j}]: only text parts (input_text, output_text) are supported, got "
                             f"{kind or p!r:.80}", "input")
    return parts


def _messages(items, instructions) -> list[dict]:
    """Responses ``input`` (+ ``instructions``) as chat messages: function_call items become the assistant's
    tool_calls (consecutive ones one turn, with the message before them), function_call_output items tool
    messages."""
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions must be a string", "instructions")
    out = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("input must be a string or a non-empty list of input items", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(f"{where}.role must be user, system, developer or assistant, got {role!r:.40}",
                                 "input")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise BadRequest(f"{where}: a function_call item needs call_id, name and arguments (strings)",
                                 "input")
            history_arguments(item["arguments"], f"{where}.arguments", "input")  # named as this request spells it
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", []), call]}
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, (str, list)):
                raise BadRequest(f"{where}: a function_call_output item needs call_id (a string) and output",
                                 "input")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(output, where)})
        elif kind == "item_reference":
            raise BadRequest(f"{where}: item_reference is not supported: {STATELESS}", "input")
        else:
            raise BadRequest(f"{where}: input items of type {kind!r:.40} are not supported (message, "
                             f"function_call, function_call_output)", "input")
    return out


def _tools(tools, tool_choice):
    """Responses' flat function tools and tool_choice in the chat endpoint's form."""
    if tools is None:
        chat_tools = None
    elif not isinstance(tools, list):
        raise BadRequest("tools must be a list of function tools", "tools")
    else:
        chat_tools = []
        for i, t in enumerate(tools):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise BadRequest(f"tools[{i}]: tools of type {kind!r:.40} are not supported: only function tools, "
                                 f"which the client runs", "tools")
            chat_tools.append({"type": "function", "function": {k: t[k] for k in
                                                                 ("name", "description", "parameters", "strict")
                                                                 if t.get(k) is not None}})
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function":
            raise BadRequest(f"tool_choice {tool_choice!r:.80} is not supported: \"auto\", \"none\", \"required\" "
                             f"or {{\"type\": \"function\", \"name\": ...}}", "tool_choice")
        tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    return chat_tools, tool_choice


def _format(text) -> dict | None:
    """``text.format`` as the chat endpoint's response_format."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if not isinstance(text, dict) or (fmt is not None and kind is None):
        raise BadRequest("text must be {\"format\": {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}}",
                         "text")
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    raise BadRequest(f"text.format.type must be text, json_object or json_schema, got {kind!r:.40}", "text")


def translate(data: dict) -> tuple[dict, Callable]:
    """(create_chat_completion's keyword arguments for the Responses request ``data``, ``shape``): ``shape(make)``
    calls ``make()`` (which runs the chat completion) and returns its result as a response object, or for a
    stream an iterator of Responses events; errors name the Responses parameters. BadRequest for what is not
    supported. Keys neither API knows are ignored, as the chat endpoint ignores them."""
    _refuse_unsupported(data)
    if "input" not in data:
        raise BadRequest("missing required parameter 'input'", "input")
    max_out = data.get("max_output_tokens")
    if max_out is not None and (isinstance(max_out, bool) or not isinstance(max_out, int) or max_out < 1):
        raise BadRequest(f"max_output_tokens must be a positive integer, got {max_out!r}", "max_output_tokens")
    tools, tool_choice = _tools(data.get("tools"), data.get("tool_choice"))
    stream = data.get("stream")
    kwargs = {k: data[k] for k in SAMPLER_EXTRAS if k in data}
    kwargs.update(messages=_messages(data["input"], data.get("instructions")), model=data.get("model"),
                  max_completion_tokens=max_out, tools=tools, tool_choice=tool_choice,
                  parallel_tool_calls=data.get("parallel_tool_calls"), response_format=_format(data.get("text")),
                  stream=stream, stream_options={"include_usage": True} if stream is True else None)
    for k in ("temperature", "top_p"):
        if data.get(k) is not None:
            kwargs[k] = data[k]
    text = data.get("text") if isinstance(data.get("text"), dict) and data["text"].get("format") else None
    head = {"id": f"resp_{_hex()}", "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None,
            "instructions": data.get("instructions"), "max_output_tokens": max_out, "max_tool_calls": None,
            "metadata": data.get("metadata") or {}, "model": data.get("model"), "output": [],
            "parallel_tool_calls": data.get("parallel_tool_calls") is not False, "previous_response_id": None,
            "reasoning": None, "store": False,
            "temperature": kwargs.get("temperature", SAMPLING_DEFAULTS["temperature"]),
            "text": text or {"format": {"type": "text"}}, "tool_choice": data.get("tool_choice") or "auto",
            "tools": data.get("tools") or [], "top_p": kwargs.get("top_p", SAMPLING_DEFAULTS["top_p"]),
            "truncation": "disabled", "usage": None, "user": data.get("user")}

    def shape(make):
        try:
            result = make()
        except BadRequest as e:
            raise BadRequest(str(e), PARAMS.get(e.param, e.param)) from None
        return _events(result, head) if stream is True else _response(result, head)

    return kwargs, shape


def _message_item(text: str, status: str) -> dict:
    return {"type": "message", "id": f"msg_{_hex()}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{_hex()}", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def _usage(u: dict) -> dict:
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def _finished(head: dict, output: list[dict], finish: str, usage: dict | None) -> dict:
    cut = finish == "length"
    return {**head, "status": "incomplete" if cut else "completed", "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "completed_at": None if cut else int(time.time()), "usage": usage and _usage(usage)}


def _response(chat: dict, head: dict) -> dict:
    choice = chat["choices"][0]
    msg, finish = choice["message"], choice["finish_reason"]
    calls = msg.get("tool_calls") or []
    output = [_message_item(msg["content"], "incomplete" if finish == "length" else "completed")
              if msg.get("content") or not calls else None] + [_call_item(c) for c in calls]
    return _finished({**head, "model": chat["model"]}, [o for o in output if o], finish, chat.get("usage"))


def _events(chunks: Iterator[dict], head: dict) -> Iterator[dict]:
    """The chat stream's chunks as Responses' events: a message item whose text streams as it is generated,
    then each tool call as a function_call item (the chat stream sends a call whole once it has parsed), then
    response.completed (or .incomplete at max_output_tokens) with the whole response."""
    seq = itertools.count()

    def ev(kind: str, **kw) -> dict:
        return {"type": kind, "sequence_number": next(seq), **kw}

    output: list[dict] = []
    msg = None  # the open message item
    text: list[str] = []

    def close_message(status: str):
        item = {**msg, "status": status, "content": [{**msg["content"][0], "text": "".join(text)}]}
        loc = {"item_id": msg["id"], "output_index": len(output)}
        yield ev("response.output_text.done", **loc, content_index=0, text=item["content"][0]["text"], logprobs=[])
        yield ev("response.content_part.done", **loc, content_index=0, part=item["content"][0])
        yield ev("response.output_item.done", output_index=len(output), item=item)
        output.append(item)

    def open_message():
        nonlocal msg
        msg = _message_item("", "in_progress")
        part, msg["content"] = msg["content"][0], []
        yield ev("response.output_item.added", output_index=len(output), item=msg)
        msg = {**msg, "content": [part]}
        yield ev("response.content_part.added", item_id=msg["id"], output_index=len(output), content_index=0,
                 part=part)

    finish, usage = "stop", None
    yield ev("response.created", response=head)
    yield ev("response.in_progress", response=head)
    try:
        for chunk in chunks:
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                delta = c["delta"]
                if delta.get("content") and msg is not False:  # the chat stream sends calls after all text
                    if msg is None:
                        yield from open_message()
                    text.append(delta["content"])
                    yield ev("response.output_text.delta", item_id=msg["id"], output_index=len(output),
                             content_index=0, delta=delta["content"], logprobs=[])
                for call in delta.get("tool_calls") or ():
                    if msg:  # the text before the calls ends its message item (False: already ended)
                        yield from close_message("completed")
                        msg = False  # closed: no second message item
                    item = _call_item(call)
                    loc = {"item_id": item["id"], "output_index": len(output)}
                    yield ev("response.output_item.added", output_index=len(output),
                             item={**item, "arguments": "", "status": "in_progress"})
                    yield ev("response.function_call_arguments.delta", **loc, delta=item["arguments"])
                    yield ev("response.function_call_arguments.done", **loc, arguments=item["arguments"],
                             name=item["name"])
                    yield ev("response.output_item.done", output_index=len(output), item=item)
                    output.append(item)
                finish = c["finish_reason"] or finish
    finally:
        chunks.close()
    if msg is None and not output:  # nothing was generated: still one (empty) message, as the non-stream answer
        yield from open_message()
    if msg:
        yield from close_message("incomplete" if finish == "length" else "completed")
    done = _finished(head, output, finish, usage)
    yield ev("response.incomplete" if done["status"] == "incomplete" else "response.completed", response=done)
