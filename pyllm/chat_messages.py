"""OpenAI chat messages and tools, and the tool calls in a model's reply: a request's messages as chat templates
read them, its tools (and the deprecated functions) checked, a forced call's prefix and constraint, and a reply in
the <tool_call> convention back as OpenAI tool_calls. pyllm/api.py's create_chat_completion is built on these.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from . import request_json
from .errors import BadRequest, PyllmError
from .runtime.schema_walk import SCHEMA_DATA
from .structured_output import structured_output_kwargs

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
# Qwen2.5 / Hermes convention: the model writes each call as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>.
# Templates that do not describe tools themselves get this instruction as a system message.
TOOL_SYSTEM_FALLBACK = (
    "You may call one or more functions to assist with the user query. The functions are described in JSON "
    "below:\n<tools>\n{tools}\n</tools>\nFor each function call, return a JSON object with the function name and "
    "arguments within <tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def _text_content(content, i: int):
    """OpenAI content: a string, None, or a list of parts of which pyllm reads the text ones, and an assistant's
    refusal parts (what the model said, sent back in a conversation's history)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in ("text", "refusal") and isinstance(p.get(kind), str):
                parts.append(p[kind])
            else:
                raise BadRequest(f"messages[{i}].content: only text parts are supported, got {p!r:.80}", "messages")
        return "".join(parts)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")


ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's message roles


def check_message_list(messages) -> None:
    """BadRequest unless ``messages`` is a non-empty list (or tuple): an empty conversation renders as a bare
    generation prompt, and the model would reply to nothing."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")


def normalize_messages(messages) -> list[dict]:
    """OpenAI messages -> what chat templates read: text content, tool-call arguments as objects (templates write
    them with ``tojson``), a tool result's name where only its call id is given."""
    check_message_list(messages)
    out, names = [], {}
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role", "messages")
        if m["role"] not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}", "messages")
        m = dict(m)
        m["content"] = _text_content(m.get("content"), i)
        # OpenAI's deprecated function calling: the role "function" is the tool role (what templates render), an
        # assistant's function_call its one tool call
        if m["role"] == "function":
            m["role"] = "tool"
        fc = m.pop("function_call", None)
        if fc is not None and not m.get("tool_calls"):
            if not (isinstance(fc, dict) and isinstance(fc.get("name"), str)):
                raise BadRequest(f"messages[{i}].function_call must be {{\"name\": string, \"arguments\": ...}}, "
                                 f"got {fc!r:.80}", "messages")
            m["tool_calls"] = [{"type": "function", "function": fc}]
        if m.get("tool_calls"):
            calls = []
            if not isinstance(m["tool_calls"], list):
                raise BadRequest(f"messages[{i}].tool_calls must be a list of calls", "messages")
            for j, c in enumerate(m["tool_calls"]):
                if not (isinstance(c, dict) and isinstance(c.get("function"), dict)
                        and isinstance(c["function"].get("name"), str) and isinstance(c.get("id", ""), str)):
                    raise BadRequest(f"messages[{i}].tool_calls[{j}] must be {{\"id\": string, \"type\": "
                                     f"\"function\", \"function\": {{\"name\": string, \"arguments\": ...}}}}, "
                                     f"got {c!r:.80}", "messages")
                fn = dict(c["function"])
                args = fn.get("arguments")
                if isinstance(args, str):
                    fn["arguments"] = history_arguments(args, f"messages[{i}].tool_calls[{j}].function.arguments")
                if isinstance(c.get("id"), str):  # a call without an id names no tool result
                    names[c["id"]] = fn.get("name")
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        elif m["content"] is None:
            m["content"] = ""
        if not isinstance(m.get("tool_call_id", ""), str):
            raise BadRequest(f"messages[{i}].tool_call_id must be a string", "messages")
        call_id = m.get("tool_call_id")
        if m["role"] == "tool" and "name" not in m and call_id in names:
            m["name"] = names[call_id]
        out.append(m)
    return out


def history_arguments(text: str, where: str, param: str = "messages"):
    """A call's ``arguments`` (JSON text, as OpenAI sends them) from a conversation's history as the value
    templates write with ``tojson``: parsed within request_json's bounds, as the request's body is. Text that is
    not JSON stays text (OpenAI takes any string there, and a model's earlier call may have been malformed); JSON
    past the bounds (nesting, size, a number no double holds, a lone surrogate) is a BadRequest naming where
    (and ``param``, the request parameter that holds it)."""
    try:
        value = request_json.loads(text)
    except request_json.JSONSyntaxError:
        return text
    except request_json.JSONLimitError as e:
        raise BadRequest(f"{where}: {e}", param) from None
    bad = request_json.lone_surrogate(value) if request_json.may_hold_surrogate(text) else None
    if bad is not None:
        raise BadRequest(f"{where}{'.' + bad[0] if bad[0] else ''} holds a lone UTF-16 surrogate ({bad[1]!a}), "
                         f"which is not Unicode text", param)
    return value


def calls_as_text(m: dict) -> dict:
    """``m`` with its tool_calls written into its content in the <tool_call> convention (what TOOL_SYSTEM_FALLBACK
    asks the model to write), for a template that does not render tool_calls: it would drop the calls, or fail on
    the null content that comes with them."""
    if not m.get("tool_calls"):
        return m
    calls = "\n".join(f"{TOOL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                     "arguments": c["function"].get("arguments", {})})
                      + f"\n{TOOL_CLOSE}" for c in m["tool_calls"])
    out = {k: v for k, v in m.items() if k != "tool_calls"}
    out["content"] = f"{m['content']}\n{calls}" if m["content"] else calls
    return out


def check_tools(tools, tool_choice) -> tuple[list[dict], str | None]:
    """(tools, forced function name) after checking; tool_choice "none" (or no tools) gives ([], None)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice needs tools", "tool_choice")
        return [], None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                              and isinstance((t.get("function") or {}).get("name"), str)
                                              for t in tools):
        raise BadRequest("tools must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}", "tools")
    names = [t["function"]["name"] for t in tools]
    if tool_choice in (None, "auto"):
        return tools, None
    if tool_choice == "none":
        return [], None
    if tool_choice == "required":
        return tools, ""
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict) \
            and tool_choice["function"].get("name") in names:
        return tools, tool_choice["function"]["name"]
    raise BadRequest(f"tool_choice must be \"auto\", \"none\", \"required\" or a function among {names}, got "
                     f"{tool_choice!r}", "tool_choice")


def legacy_functions(functions, function_call, tools, tool_choice) -> tuple[list | None, Any, bool]:
    """(tools, tool_choice, legacy) of a request that may use OpenAI's deprecated ``functions`` (a list of
    function definitions) and ``function_call`` ("none", "auto" or {"name": ...}); ``legacy``: it did, and a call
    is answered in their shape. Ignored, they left the model unaware of the functions it was offered."""
    if functions is None:
        if function_call is not None:
            raise BadRequest("function_call needs functions", "function_call")
        return tools, tool_choice, False
    if tools:
        raise BadRequest("functions is the deprecated form of tools: send one or the other", "functions")
    if not isinstance(functions, list) or not all(isinstance(f, dict) and isinstance(f.get("name"), str)
                                                  for f in functions):
        raise BadRequest("functions must be a list of {\"name\": ..., \"parameters\": ...}", "functions")
    names = [f["name"] for f in functions]
    if isinstance(function_call, dict) and function_call.get("name") in names:
        function_call = {"type": "function", "function": {"name": function_call["name"]}}
    elif function_call not in (None, "none", "auto"):
        raise BadRequest(f"function_call must be \"none\", \"auto\" or {{\"name\": one of {names}}}, got "
                         f"{function_call!r:.80}", "function_call")
    return [{"type": "function", "function": f} for f in functions], function_call, True


def forced_call(llm, tools, name: str, constraint: dict) -> tuple[str, dict]:
    """(reply prefix, constraint) forcing a tool call: "required" opens a call object; a named function also
    writes the name. Where the runtime can constrain output, the whole call object is constrained: its name is one
    of the tools' (the named one), its arguments follow that tool's JSON schema; otherwise the model continues
    freely after the prefilled name."""
    if constraint:
        raise BadRequest("response_format cannot be combined with a forced tool call", "tool_choice")
    calls, defs = [], {}
    for i, t in enumerate(tools):
        if name and t["function"]["name"] != name:
            continue
        schema = t["function"].get("parameters")
        if schema is None:
            # OpenAI: "omitting parameters defines a function with an empty parameter list". Read as "any JSON
            # value" it let the model write arguments like [1, 2, 3], which no client can pass to the function.
            schema = {"type": "object", "properties": {}, "additionalProperties": False}
        elif schema is False:  # a valid JSON schema that nothing matches (``or {}`` made it "anything")
            raise BadRequest(f"tools: the parameters of {t['function']['name']!r} are false, which no arguments "
                             f"can match", "tools")
        if isinstance(schema, dict):
            # The call object is now the document's root, where the schema's own references ("#/$defs/City",
            # "#") no longer resolve. Each tool's schema moves whole under the root's $defs, its references
            # rebased onto where it now sits: two tools that define one name differently keep their own.
            key = f"tool{i}"
            defs[key] = _rebase_refs(schema, f"#/$defs/{key}")
            schema = {"$ref": f"#/$defs/{key}"}
        # Closed: a call is its name and arguments, and keys past them (small models go on to "type",
        # "parameters", ...) only spend the token budget until the call is cut off, finish_reason "length".
        calls.append({"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       "arguments": schema}, "required": ["name", "arguments"],
                      "additionalProperties": False})
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if defs:
        call = {**call, "$defs": defs}
    try:
        return TOOL_OPEN + "\n", structured_output_kwargs(llm, json_schema=call, param="tools")
    except BadRequest:  # a tool's parameters are not a usable schema
        raise
    except PyllmError:
        pass
    if name:
        return TOOL_OPEN + '\n{"name": "' + name + '", "arguments":', {}
    # The call is opened up to the name's quote: after a bare "<tool_call>\n" small models tend to end the turn.
    return TOOL_OPEN + '\n{"name": "', {}


def _rebase_refs(schema: dict, base: str) -> dict:
    """A copy of ``schema`` whose local references ("#" and "#/..." JSON pointers) point where they pointed once
    the schema sits at ``base`` (a "#/..." pointer) of a larger document. Iterative: a schema may nest deeply.
    The root's ``$id`` goes (an embedded resource the engine would not resolve against), and references spelled
    through it ("https://x/s.json#/$defs/A") become local ones."""
    root_id = schema.get("$id")
    if isinstance(root_id, str):
        schema = {k: v for k, v in schema.items() if k != "$id"}
        root_id = root_id.rstrip("#")
    out: dict = {}
    stack = [(schema, out)]
    while stack:
        src, dst = stack.pop()
        items = src.items() if isinstance(src, dict) else enumerate(src)
        for k, v in items:
            ref = isinstance(src, dict) and k == "$ref" and isinstance(v, str)
            if ref and root_id and (v == root_id or v.startswith(root_id + "#")):
                v = v[len(root_id):] or "#"
            if ref and (v == "#" or v.startswith("#/")):
                v = base + v[1:]
            elif isinstance(v, (dict, list)) and not (isinstance(src, dict) and k in SCHEMA_DATA):
                copy = {} if isinstance(v, dict) else [None] * len(v)
                stack.append((v, copy))
                v = copy
            dst[k] = v
    return out


def _call(obj, names, values: bool = False) -> dict | None:
    """The OpenAI tool call for the call object ``obj``, or None. OpenAI's ``arguments`` is JSON text: a string a
    model wrote there is taken as that text when it holds a JSON object (some models encode the arguments, as the
    API does), else as the value itself. ``values``: the arguments were constrained to the tool's schema, so
    they are the value whatever it is (a schema may admit a string)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or (names and obj["name"] not in names):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not (isinstance(args, str) and not values and _json_object_text(args)):
        args = json.dumps(args)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args}}


def _json_object_text(text: str) -> bool:
    try:
        return isinstance(request_json.loads(text), dict)
    except ValueError:
        return False


def _reply_json(text: str):
    """The JSON value of a call the model wrote, or None where it is not one within request_json's bounds (too
    deep, too long a number, not JSON): the reply then stays text, as vLLM's tool parsers leave it."""
    try:
        return request_json.loads(text)
    except ValueError:
        return None


FENCED = re.compile(r"\s*(?:```(?:json)?\s*)?(\{.*\})\s*(?:```)?\s*", re.S)
# A reply that may still turn out to be a call: held back (not streamed) until the reply ends.
CALL_STARTS = (TOOL_OPEN, "{", "```")


def parse_tool_calls(text: str, names: list[str] | None = None,
                     values: bool = False) -> tuple[str | None, list[dict]]:
    """(content before the first call or None, OpenAI tool_calls) from a reply in the <tool_call> convention. A
    call whose JSON does not parse (or is past request_json's bounds) leaves the whole reply as content. Small models sometimes answer with the bare
    call object instead (optionally in a ```json fence): a whole reply that is {"name": <one of names>,
    "arguments": ...} is a call too. ``values``: as ``_call``'s."""
    start = text.find(TOOL_OPEN)
    if start < 0:
        m = FENCED.fullmatch(text)
        if m:
            call = _call(_reply_json(m.group(1)), names or [""], values)
            if call:
                return None, [call]
        return text, []
    calls = []
    for m in re.finditer(re.escape(TOOL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CLOSE) + r"|$)", text[start:],
                         re.S):
        call = _call(_reply_json(m.group(1)), None, values)
        if call is None:
            return text, []
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls
