"""JSON from a request, parsed within bounds: the server's request bodies, the tool-call arguments a conversation
carries as JSON text, and the tool calls a model writes.

Python's json module alone reads what JSON does not allow (NaN, Infinity, numbers past a double's range, which
then no response can carry back), recurses once per nesting level (a few kB of "[[[[" exhaust the stack, and a
value a few hundred levels deep makes every later recursive walk fail: repr, json.dumps, a template's tojson),
and turns 8 MiB of "[]," into 2.8 million lists, 200 MiB held while one C call runs with the GIL. ``shape``
measures a text before it is parsed, in a few vectorized passes and nothing recursive: nesting depth, containers,
values, escapes, and upper bounds of the memory the parsed value and its parse take (what the server admits
requests by); ``loads``
refuses what is past the limits before parsing and what is not JSON while parsing.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, NamedTuple

import numpy as np

from .errors import shorten

MAX_DEPTH = 64  # a chat request nests 5-6 levels, a tool's JSON schema some more; Python's parser 1000 at most
MAX_CONTAINERS = 100_000  # objects and arrays: a 10,000-message conversation with tool calls holds ~40,000
MAX_VALUES = 1_000_000  # values and keys: a prompt of token ids as long as a 128k context is 128k
MAX_ESCAPES = 1_000_000  # backslashes: 1 MiB of code as JSON text has ~60,000 (its newlines and quotes)
# Bytes of CPython 3.11 objects, upper bounds (measured with tracemalloc over tests/test_request_json.py's corpus):
# a value or key costs its object (a short str 50-80, a float 24, an int 28-36) and its slot (a list's pointer, a
# dict's entry and index, both over-allocated); a container its own header beyond that (a list 56 + GC 16, a dict
# 64-232 + GC 16). A string's characters cost 1 byte each, or up to 4 where a string holds any character past
# U+00FF (all its characters are then 2 or 4 bytes wide): the text's length bounds them.
VALUE_BYTES = 120
CONTAINER_BYTES = 280
BASE_BYTES = 64 << 10  # the parse's own few objects
# While it parses a string, CPython's scanner (3.11) keeps a list of pieces, one per escape and one per run of text
# between escapes: a pointer each, and a str object for each run (50 bytes and more). The text it parses is up to 4
# bytes a character, and decoding and scanning take up to twice that again.
ESCAPE_BYTES = 80


class JSONSyntaxError(ValueError):
    """The text is not JSON (not UTF-8, malformed, NaN or Infinity)."""


class JSONLimitError(ValueError):
    """The text is JSON past a limit: nesting, containers, values, or a number's size."""


class JSONShape(NamedTuple):
    depth: int  # deepest nesting of arrays and objects (0 when ``containers`` is past MAX_CONTAINERS: not measured)
    containers: int
    values: int  # an upper bound: every comma and colon outside strings, and each container, start one
    escapes: int  # backslashes
    parsed_bytes: int  # an upper bound of the memory the parsed value takes
    parse_bytes: int  # an upper bound of what parsing takes besides, until it returns


_KIND = np.zeros(256, np.uint8)  # what each byte is outside strings: 1 opens, 2 closes, 3 separates
_KIND[[ord("["), ord("{")]] = 1
_KIND[[ord("]"), ord("}")]] = 2
_KIND[[ord(","), ord(":")]] = 3


def _string_quotes(a: np.ndarray) -> np.ndarray:
    """Positions of the quotes in ``a`` that open or close a string: those after no backslash, or after an even
    run of them (an escaped backslash)."""
    quotes = np.flatnonzero(a == ord('"'))
    slashes = np.flatnonzero(a == ord("\\"))
    if not len(quotes) or not len(slashes):
        return quotes
    starts = np.ones(len(slashes), bool)
    starts[1:] = slashes[1:] != slashes[:-1] + 1
    run_start = np.maximum.accumulate(np.where(starts, np.arange(len(slashes)), 0))
    k = np.minimum(np.searchsorted(slashes, quotes - 1), len(slashes) - 1)
    escaped = (slashes[k] == quotes - 1) & ((k - run_start[k]) % 2 == 0)  # a run of odd length ends just before
    return quotes[~escaped]


def shape(raw: bytes | bytearray) -> JSONShape:
    """The shape of the JSON text ``raw`` (UTF-8), without parsing it: brackets, commas and colons inside strings
    do not count. Transient memory: about twice ``raw``'s length. Text that is not JSON gets some shape; the parser
    refuses it after."""
    a = np.frombuffer(raw, np.uint8)
    inside = np.zeros(len(a), np.uint8)
    inside[_string_quotes(a)] = 1
    np.bitwise_xor.accumulate(inside, out=inside)  # 1 from an opening quote up to its closing one
    kind = _KIND[a]
    inside -= 1  # 0 inside strings, 255 outside
    kind &= inside
    del inside
    opens, closes, seps = (int(np.count_nonzero(kind == k)) for k in (1, 2, 3))
    depth = 0
    if opens <= MAX_CONTAINERS and closes <= opens:
        brackets = kind[(kind == 1) | (kind == 2)].astype(np.int32)
        depth = int(np.cumsum(3 - 2 * brackets).max(initial=0))
    wide = 4 if not raw.isascii() or b"\\u" in raw else 1
    values = seps + opens + 1
    escapes = int(np.count_nonzero(a == ord("\\")))
    return JSONShape(depth, opens, values, escapes,
                     BASE_BYTES + wide * len(raw) + VALUE_BYTES * values + CONTAINER_BYTES * opens,
                     3 * wide * len(raw) + ESCAPE_BYTES * escapes)


def check_shape(s: JSONShape) -> None:
    """JSONLimitError for a shape past the limits."""
    if s.containers > MAX_CONTAINERS:
        raise JSONLimitError(f"it holds {s.containers} arrays and objects; the limit is {MAX_CONTAINERS}")
    if s.values > MAX_VALUES:
        raise JSONLimitError(f"it holds over {MAX_VALUES} values")
    if s.escapes > MAX_ESCAPES:
        raise JSONLimitError(f"it holds over {MAX_ESCAPES} backslash escapes")
    if s.depth > MAX_DEPTH:
        raise JSONLimitError(f"arrays and objects nest too deeply ({s.depth} levels; the limit is {MAX_DEPTH})")


def _not_json_constant(name: str):
    raise JSONSyntaxError(f"{name} is not JSON (JSON numbers are finite)")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise JSONLimitError(f"the number {shorten(text, 40)} is past a double's range")
    return v


def utf8_text(raw: bytes | bytearray) -> str:
    """``raw`` as text (a UTF-8 byte order mark dropped), JSONSyntaxError naming the first byte that is not
    UTF-8. RFC 8259: JSON exchanged between systems is UTF-8 (Python's parser also guessed UTF-16 and -32)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JSONSyntaxError(f"it is not UTF-8 (byte {raw[e.start]:#04x} at offset {e.start})") from None
    return text[1:] if text.startswith("\ufeff") else text  # utf-8-sig's codec copies every text twice


def loads(raw: bytes | bytearray | str, known: JSONShape | None = None) -> Any:
    """The JSON value of ``raw`` (bytes: UTF-8), within MAX_DEPTH, MAX_CONTAINERS and MAX_VALUES and with every
    number a finite double (or an int of at most 4300 digits, Python's limit). JSONSyntaxError for what is not
    JSON, JSONLimitError for what is past a limit; each message says what and where. ``known``: ``raw``'s shape,
    when the caller measured it already."""
    if isinstance(raw, str):
        text, raw = raw, raw.encode("utf-8", "surrogatepass")
    else:
        text = utf8_text(raw)
    check_shape(known or shape(raw))
    try:
        return json.loads(text, parse_constant=_not_json_constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise JSONSyntaxError(str(e)) from None
    except (JSONSyntaxError, JSONLimitError):
        raise
    except ValueError as e:  # an integer of over 4300 digits; the advice to call a Python function goes
        raise JSONLimitError(re.sub(r";? *use sys\.set_int_max_str_digits\(\).*", "", str(e))) from None
    except RecursionError:  # not reached after the depth check, unless the caller's own stack is deep already
        raise JSONLimitError("arrays and objects nest too deeply") from None


SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(value: Any, path: str = "") -> tuple[str, str] | None:
    """(where, the character) of the first lone UTF-16 surrogate in the strings or keys of ``value``, or None:
    what JSON's "\\ud800" escape decodes to when no low half follows, which is not Unicode text and which no
    UTF-8 response can carry. ``where`` extends ``path`` (".key", "[i]", "a key of ..."). Iterative: the value may
    nest deeply."""
    stack = [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            m = SURROGATE.search(v)
            if m:
                return where, m.group()
        elif isinstance(v, dict):
            for k in v:
                m = SURROGATE.search(k)
                if m:
                    return f"a key of {where or 'the object'}", m.group()
            stack.extend((f"{where}.{k}" if where else k, x) for k, x in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in reversed(list(enumerate(v))))
    return None


def may_hold_surrogate(raw: bytes | bytearray | str) -> bool:
    """Whether the JSON text ``raw`` can decode to a lone surrogate: only its escape can (UTF-8 has none)."""
    return re.search(r"\\u[dD][89a-fA-F]" if isinstance(raw, str) else rb"\\u[dD][89a-fA-F]", raw) is not None
