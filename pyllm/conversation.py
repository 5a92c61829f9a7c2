"""The conversation file `pyllm chat`'s /save writes and /load reads: JSON with a "messages" list of role/content
turns (a plain list of such messages is read too), bounded in size and nesting, lone surrogates kept exactly."""

from __future__ import annotations

import json
import re

from .errors import PyllmError
from .safe_io import json_depth

ROLES = ("system", "user", "assistant")


def parse_conversation(data, source: str = "conversation") -> tuple[str | None, list[dict]]:
    """(system prompt, turns) from what /save writes or from a plain [{"role", "content"}] list."""
    if isinstance(data, dict):
        if "messages" not in data:
            raise PyllmError(f"{source}: no 'messages' list (expected what /save writes)")
        data = data["messages"]
    if not isinstance(data, list):
        raise PyllmError(f"{source}: expected a list of messages, got {type(data).__name__}")
    system, turns = None, []
    for i, m in enumerate(data):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise PyllmError(f"{source}: message {i} must be {{\"role\": one of {', '.join(ROLES)}, "
                             f"\"content\": text}}, got {str(m)[:80]}")
        if m["role"] == "system":
            if i != 0:
                raise PyllmError(f"{source}: message {i} is a system message; only the first may be one")
            system = m["content"]
        else:
            turns.append({"role": m["role"], "content": m["content"]})
    return system, turns


MAX_CONVERSATION_BYTES = 64 << 20
MAX_JSON_DEPTH = 32  # a saved conversation nests 3 deep; deeper is not a conversation
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def dump_conversation(data) -> str:
    """JSON text for /save. Readable UTF-8, except that lone surrogates (text from bytes that were not UTF-8 has
    them) are written as \\uXXXX escapes: they have no UTF-8 form, and json.loads restores them exactly."""
    text = json.dumps(data, ensure_ascii=False, indent=1) + "\n"
    return LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def load_conversation_json(raw: bytes):
    """Parsed JSON of a conversation file: UTF-8, nesting bounded (ValueError otherwise)."""
    text = raw.decode("utf-8")
    if json_depth(raw, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise ValueError(f"it nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("it nests too deeply") from None
