"""pyllm/request_json.py: the bounded parser every JSON text of a request goes through (the server's bodies, tool-call
arguments in a conversation, the calls a model writes).

References: Python's json module (what the text parses to, where it does) and the parsed value itself (its depth,
containers and separators counted by an iterative walk); tracemalloc for the memory the parsed value takes, which
``shape``'s estimate must bound; RFC 8259 for what JSON is (UTF-8, finite numbers).
"""

import gc
import json
import random
import tracemalloc

import pytest

from pyllm import request_json as rj


def _reference_shape(value) -> tuple[int, int, int]:
    """(depth, containers, separators) of a parsed value: separators are the commas and colons its text has."""
    depth = containers = seps = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            containers += 1
            depth = max(depth, d)
            n = len(v)
            seps += max(n - 1, 0) + (n if isinstance(v, dict) else 0)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return depth, containers, seps


_STRING_CHARS = ['"', "\\", "[", "]", "{", "}", ",", ":", "a", "é", "\U0001F600", "\n", "\\\\", '\\"', "\u2028"]


def _random_value(rng: random.Random, depth: int):
    r = rng.random()
    if depth <= 0 or r < 0.3:
        kind = rng.randrange(6)
        if kind == 0:
            return "".join(rng.choice(_STRING_CHARS) for _ in range(rng.randrange(6)))
        if kind == 1:
            return rng.randrange(-10**20, 10**20)
        if kind == 2:
            return rng.uniform(-1e300, 1e300)
        return [None, True, False][kind - 3]
    if r < 0.65:
        return [_random_value(rng, depth - 1) for _ in range(rng.randrange(4))]
    return {"".join(rng.choice(_STRING_CHARS) for _ in range(rng.randrange(4))) + str(i): _random_value(rng, depth - 1)
            for i in range(rng.randrange(4))}


def test_shape_counts_what_the_parsed_value_holds_and_nothing_inside_strings():
    """Over 400 random documents whose strings hold brackets, commas, colons, quotes and backslashes (escaped as
    JSON escapes them, and with ensure_ascii both ways), shape's depth, containers and values match the parsed
    value's exactly (values: separators + containers + 1)."""
    rng = random.Random(51)
    for i in range(400):
        value = _random_value(rng, rng.randrange(1, 9))
        text = json.dumps(value, ensure_ascii=bool(i % 2), separators=(",", ":") if i % 3 else (", ", ": "))
        depth, containers, seps = _reference_shape(value)
        s = rj.shape(text.encode())
        assert (s.depth, s.containers, s.values) == (depth, containers, seps + containers + 1), text


# Shapes that take the most memory per byte of text in CPython: many small containers, short strings (wide ones
# too), numbers, and the big-string cases where the estimate's per-byte factor is tight.
N = 1 << 18
CORPUS = {
    "empty objects": b"[" + b"{}," * (N // 3) + b"{}]",
    "empty arrays": b"[" + b"[]," * (N // 3) + b"[]]",
    "nested arrays": b"[" + b"[[1]]," * (N // 6) + b"1]",
    "one-key objects": b"[" + b'{"a":1},' * (N // 8) + b"1]",
    "objects of arrays": b"[" + b'{"a":[]},' * (N // 9) + b"1]",
    "six-key objects": b"[" + b'{"a":1,"b":2,"c":3,"d":4,"e":5,"f":6},' * (N // 38) + b"1]",
    "distinct keys": b"{" + b",".join(b'"%d":"%d"' % (i, i) for i in range(N // 14)) + b"}",
    "two-char strings": b"[" + b'"ab",' * (N // 5) + b'""]',
    "wide strings": b"[" + "\"\u0100\",".encode() * (N // 5) + b'""]',
    "astral strings": b"[" + "\"\U0001F600a\",".encode() * (N // 8) + b'""]',
    "escaped astral": b"[" + b'"\\ud83d\\ude00",' * (N // 15) + b'""]',
    "integers": b"[" + b"300," * (N // 4) + b"1]",
    "big integers": b"[" + b"10000000000000000000000," * (N // 24) + b"1]",
    "floats": b"[" + b"1.5," * (N // 4) + b"1]",
    "one string": b'"' + b"a" * N + b'"',
    "one string, one wide character": b'"\\u0100' + b"a" * N + b'"',
    "one string, one astral character": b'"\\ud83d\\ude00' + b"a" * N + b'"',
    "chat messages": b'{"messages":[' + b'{"role":"user","content":"hi there"},' * (N // 40) + b'1]}',
    "escapes": b'"' + b"\\n" * (N // 2) + b'"',
    "escapes between text": b'"' + b"ab\\n" * (N // 4) + b'"',
    "escaped wide characters between text": b'"' + b"ab\\u0100" * (N // 8) + b'"',
}


@pytest.mark.parametrize("name", CORPUS)
def test_the_estimate_bounds_the_memory_the_parsed_value_takes(name):
    """Reference: tracemalloc's count of what request_json.loads allocates and keeps (the parsed value), which
    shape's parsed_bytes (what the server admits a request by) must not be below, and not above 20 times it, or
    the server would refuse requests it has room for; and of its peak, which parsed_bytes + parse_bytes must not
    be below (CPython's string scanner keeps a piece per escape while it works: 13x the text for "\\n\\n...")."""
    raw = bytearray(CORPUS[name])
    s = rj.shape(raw)
    # No collection runs while it is traced: the parse makes no cyclic garbage, and on the heap of a whole test
    # session one pass over it takes most of a second.
    gc.disable()
    tracemalloc.start()
    try:
        value = rj.loads(raw, s)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        gc.enable()
    del value
    assert kept <= s.parsed_bytes <= 20 * kept + rj.BASE_BYTES, (kept, s)
    assert peak <= s.parsed_bytes + s.parse_bytes, (peak, s)


def test_loads_refuses_what_is_not_json_or_past_a_limit_before_parsing():
    """Each refusal is a ValueError of its class with a message naming the problem. Depth is measured without
    recursing, so 100,000 levels cost no stack; NaN/Infinity (Python's extension) and numbers past a double or
    Python's 4300-digit limit are refused as the server's body is; bytes that are not UTF-8 (Python's parser
    guessed UTF-16 and -32) too."""
    cases = [(b"[" * 100_000 + b"]" * 100_000, rj.JSONLimitError, "nest too deeply"),
             (b"[" * (rj.MAX_DEPTH + 1) + b"]" * (rj.MAX_DEPTH + 1), rj.JSONLimitError, f"limit is {rj.MAX_DEPTH}"),
             (b'{"a": "' + b"[" * 5000 + b'"}', None, None),  # brackets in a string are text
             (b"[" + b"[]," * rj.MAX_CONTAINERS + b"[]]", rj.JSONLimitError, "arrays and objects"),
             (b"[" + b"0," * rj.MAX_VALUES + b"0]", rj.JSONLimitError, "values"),
             (b'"' + b"\\n" * (rj.MAX_ESCAPES + 1) + b'"', rj.JSONLimitError, "escapes"),
             (b'{"a": NaN}', rj.JSONSyntaxError, "NaN is not JSON"),
             (b"[-Infinity]", rj.JSONSyntaxError, "-Infinity is not JSON"),
             (b"[1e400]", rj.JSONLimitError, "1e400 is past a double's range"),
             (b"[" + b"9" * 5000 + b"]", rj.JSONLimitError, "4300 digits"),
             (b'["caf\xe9"]', rj.JSONSyntaxError, "not UTF-8 (byte 0xe9 at offset 5)"),
             ('["x"]'.encode("utf-16"), rj.JSONSyntaxError, "not UTF-8"),
             (b'["\xed\xa0\x80"]', rj.JSONSyntaxError, "not UTF-8"),  # a surrogate encoded as UTF-8
             (b'{"a": 1', rj.JSONSyntaxError, "Expecting"),
             (b"]]]]" + b"[" * 10, rj.JSONSyntaxError, "Expecting value")]
    for raw, err, needle in cases:
        if err is None:
            assert rj.loads(raw) == {"a": "[" * 5000}
            continue
        with pytest.raises(err) as e:
            rj.loads(raw)
        assert needle in str(e.value) and "sys." not in str(e.value), (raw[:40], str(e.value))
    assert rj.loads(b"\xef\xbb\xbf[1e-400, 1e300]") == [0.0, 1e300]  # a BOM is dropped; underflow is a number
    assert rj.loads('{"a": "\\u00e9"}') == {"a": "é"}  # str in, too
