"""JSON-schema numbers the constraint engine (llguidance) would change or cannot compile, caught before it sees
the schema: integer consts and enums it would round, integer bounds moved inwards to values it keeps exactly, and
number bounds it cannot write refused naming their JSON pointer (pyllm/runtime/constraint.py compiles the rest)."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any

from ..errors import PyllmError, shorten

# Keywords whose values are data, not schemas; and those whose values map names (not keywords) to subschemas
SCHEMA_DATA = frozenset(["const", "enum", "default", "examples"])
SCHEMA_MAPS = frozenset(["properties", "patternProperties", "$defs", "definitions", "dependentSchemas"])

# The engine reads a schema's numbers as 64-bit floats and integer bounds as 64-bit integers: an integer past 2^53
# may come out rounded, and a bound at or past +-2^63 fails to compile or is cut to 2^63 - 1. Within +-BOUND_EDGE
# (the largest double below 2^63) every double is an integer bound it keeps exactly.
BOUND_EDGE = 2 ** 63 - 1024
OPEN_RANGE_LIMIT = 10 ** 18
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum")


def _pointer(path: str, key) -> str:
    return f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"


def _as_written(v: int) -> str:
    """The text the engine writes for the integer ``v`` of a const or enum: the shortest digits of the nearest
    double, as an integer (2^53 + 1 -> 9007199254740992, 2^63 + 1 -> 9223372036854776000)."""
    try:
        return str(int(Decimal(repr(float(v)))))
    except OverflowError:
        return "infinity"


def _inwards(v: int, lower: bool) -> int:
    """The integer bound ``v`` moved inwards (up for a lower bound) to the nearest double within +-BOUND_EDGE."""
    f = float(min(max(v, -BOUND_EDGE), BOUND_EDGE))
    if lower and f < v:
        f = math.nextafter(f, math.inf)
    elif not lower and f > v:
        f = math.nextafter(f, -math.inf)
    return int(f)


def _integer_only(s: dict) -> bool:
    """Whether ``s`` admits integers but not other numbers: the engine bounds it as integers (64-bit), and
    bounds a schema whose type is "number", lists "number" or is not given as numbers (64-bit floats), whatever
    the JSON spelling of the bound (1e19 or 10000000000000000000)."""
    t = s.get("type")
    types = [t] if isinstance(t, str) else t if isinstance(t, list) else []
    return "integer" in types and "number" not in types


def exact_integers(schema: Any) -> Any:
    """``schema`` with its integer bounds moved to the nearest value the engine keeps exactly, inwards (a
    minimum of 2^53 + 1 becomes 2^53 + 2, a maximum of 2^64 becomes BOUND_EDGE: the range can only narrow, never
    admit a value the schema refuses), or None if none needs to move; edited in place. PyllmError naming the value
    and where it is for an integer in a const or enum the engine would write as another number, and for a bound
    that leaves no integer it can write (a minimum above BOUND_EDGE). Iterative: a schema may nest deeply."""
    changed = False
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        s, path = stack.pop()
        if isinstance(s, list):
            stack.extend((v, _pointer(path, i)) for i, v in enumerate(s))
            continue
        if not isinstance(s, dict):
            continue
        for k, v in list(s.items()):  # a far end may be added
            if k in ("const", "enum"):
                data = [(v, _pointer(path, k))]
                while data:
                    d, at = data.pop()
                    if isinstance(d, dict):
                        data.extend((x, _pointer(at, i)) for i, x in d.items())
                    elif isinstance(d, list):
                        data.extend((x, _pointer(at, i)) for i, x in enumerate(d))
                    elif isinstance(d, int) and not isinstance(d, bool) and _as_written(d) != str(d):
                        raise PyllmError(f"invalid json_schema: {at or '/'} is {shorten(d)}, which the engine would "
                                         f"write as {shorten(_as_written(d))} (it keeps numbers as 64-bit floats, "
                                         f"exact for integers up to 2^53); give it as a string")
            elif k in _LOWER_BOUNDS + _UPPER_BOUNDS and isinstance(v, (int, float)) and not isinstance(v, bool) \
                    and _integer_only(s) and (isinstance(v, int) or v.is_integer()):
                # a bound spelled as a float (1e19) is the integer it equals: the engine saturates it to 2^63 - 1,
                # or fails on it, as it does the integer spelling, so it is moved or refused the same way
                given, v = v, int(v)
                lower = k in _LOWER_BOUNDS
                edge = BOUND_EDGE - k.startswith("exclusive")
                if (v > edge) if lower else (v < -edge):
                    raise PyllmError(f"invalid json_schema: {_pointer(path, k)} is {shorten(given)}, beyond the "
                                     f"integers the engine can bound (-{BOUND_EDGE}..{BOUND_EDGE})")
                exact = _inwards(v, lower)
                if (exact != v or abs(v) >= 2 ** 53) and k.startswith("exclusive"):
                    # rounded inwards, the bound could pass the one integer left (exclusiveMinimum 2^63 - 1025
                    # moved to 2^63 - 1024 excludes it): as an inclusive bound, the next integer on rounds instead.
                    # Kept, from 2^53 up it is stepped past in floats by the engine, where 2^53 + 1 is 2^53: an
                    # exclusiveMinimum of 2^53 (or 9.2e18) admitted the bound itself
                    del s[k]
                    k = _LOWER_BOUNDS[0] if lower else _UPPER_BOUNDS[0]
                    exact = _inwards(v + 1 if lower else v - 1, lower)
                    old = s.get(k)
                    if isinstance(old, (int, float)) and not isinstance(old, bool):
                        exact = max(old, exact) if lower else min(old, exact)
                # written as the integer even where it keeps its value: the engine steps past a float exclusive
                # bound in floats, and 9.2e18 + 1 is 9.2e18, so an exclusiveMinimum of 9.2e18 admitted 9.2e18
                if exact != v or isinstance(given, float):
                    s[k] = exact
                    changed = True
                # the engine cannot write an open-ended range from 10^18 up (or down from -10^18): it fails to
                # compile one, so the far end is given as the edge, which no integer it writes passes anyway
                if abs(v) >= OPEN_RANGE_LIMIT and (v > 0) == lower \
                        and not any(b in s for b in (_UPPER_BOUNDS if lower else _LOWER_BOUNDS)):
                    s["maximum" if lower else "minimum"] = BOUND_EDGE if lower else -BOUND_EDGE
                    changed = True
            elif k in SCHEMA_MAPS and isinstance(v, dict):
                stack.extend((x, _pointer(_pointer(path, k), name)) for name, x in v.items())
            elif k not in SCHEMA_DATA and isinstance(v, (dict, list)):
                stack.append((v, _pointer(path, k)))
    return schema if changed else None


# The engine writes a bounded number (not integer) as plain decimals, splitting its range at 0 and, for a range
# open on one side, at the next power of ten past the bound, and parses each piece's integral ends as a 64-bit
# integer: a bound of magnitude 2^63 or more (past BOUND_EDGE, as doubles go) fails, and so does a minimum of 10^18
# or more with no maximum (or a maximum of -10^18 or less with no minimum), whose next power of ten is 10^19. It
# says so naming only the range ("Failed to generate regex for float range: min=None, max=Some(1e19)"), and it
# reads a bound's digits with rounding of its own (9.223372036854775e18, BOUND_EDGE, is its 2^63). No bound
# can be dropped or moved instead: the digits a number may have grow with the schema's own numbers (_digit_cap),
# so values past the bound stay writable and a changed bound would admit or refuse some.
_FLOAT_RANGE = re.compile(r"Failed to generate regex for (float|integer) range: min=(?:None|Some\(([^)]*)\)), "
                          r"max=(?:None|Some\(([^)]*)\))")


def _bounds(schema: Any):
    """(its schema, JSON pointer, key, value) of each numeric bound in ``schema``, in document order."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        s, path = stack.pop()
        if isinstance(s, list):
            stack.extend((v, _pointer(path, i)) for i, v in reversed(list(enumerate(s))))
        elif isinstance(s, dict):
            for k, v in list(s.items()):
                if k in _LOWER_BOUNDS + _UPPER_BOUNDS and isinstance(v, (int, float)) and not isinstance(v, bool):
                    yield s, _pointer(path, k), k, v
            stack.extend((v, _pointer(path, k)) for k, v in reversed(list(s.items()))
                         if k not in SCHEMA_DATA and isinstance(v, (dict, list)))


def number_bound_refusal(message: str, schema: Any) -> str | None:
    """One line naming the JSON pointer and value of the number bound the engine's ``message`` refuses without
    saying where, or None if ``message`` is not that refusal."""
    m = _FLOAT_RANGE.search(message)
    if m is None:
        return None
    # a type that lists both "integer" and "number" is bounded both ways, and the integer side fails first on an
    # open range, or on a bound it saturated to +-2^63 (a minimum of 2^64 reads as 9223372036854775807)
    saturates = m.group(1) == "integer"
    lo, hi = (float(g) if g is not None else None for g in m.groups()[1:])
    if lo is not None and (abs(lo) > BOUND_EDGE or (hi is None and lo >= OPEN_RANGE_LIMIT)):
        value, keys, lower = lo, _LOWER_BOUNDS, True
    elif hi is not None:
        value, keys, lower = hi, _UPPER_BOUNDS, False
    else:
        return None
    if abs(value) > BOUND_EDGE:
        why = f"beyond the numbers the engine can bound (-{BOUND_EDGE}..{BOUND_EDGE})"
    else:
        why = (f"but the range has no {'maximum' if lower else 'minimum'}: the engine bounds a number range open "
               f"{'above' if lower else 'below'} only from {'below 10^18' if lower else 'above -10^18'}")
    # the bound on that side nearest the engine's value, first in document order: the engine reads a bound's
    # decimal digits with rounding of its own (9.999999999999999e17 is its 1e18), so equality could miss it
    where, best = None, math.inf
    for _, at, k, v in _bounds(schema):
        if k in keys:
            f = min(max(float(v), -2.0 ** 63), 2.0 ** 63) if saturates else float(v)
            if abs(f - value) < best:
                where, best, given = at, abs(f - value), v
    if where is None or best > abs(value) * 1e-9:
        return f"invalid json_schema: a number {'minimum' if lower else 'maximum'} is {value!r}, {why}"
    read = "" if float(given) == value or saturates else f" (read by the engine as {value!r})"
    return f"invalid json_schema: {where} is {shorten(given)}{read}, {why}"


# A number bound with many decimal places (a minimum of 1e-100) becomes a range pattern nested about once per
# place, and the engine's regex parser stops at 250 levels: it says only "exceed the maximum number of nested
# parentheses/brackets (250)", which a "pattern" nesting that deep says too. How many places fit depends on the
# bound's side and digits (1e-81 as a minimum, 1.2345e-76, 1e-99 as a maximum), so the culprit is found by compiling
# again without the schema's number bounds that have decimal places.
_TOO_NESTED = "exceed the maximum number of nested parentheses"


def _places(v: float) -> int:
    exponent = Decimal(repr(v)).as_tuple().exponent
    return -exponent if isinstance(exponent, int) and exponent < 0 else 0


def deep_bound_refusal(message: str, schema: Any, compiles) -> str | None:
    """One line naming the JSON pointer and value of the number bound with the most decimal places, when the
    engine's ``message`` is its nesting limit and the schema compiles (``compiles(schema)``) without the number
    bounds that have decimal places; None otherwise. ``schema`` is edited."""
    if _TOO_NESTED not in message:
        return None
    found = [(_places(v), at, v, s, k) for s, at, k, v in _bounds(schema)  # (places, pointer, value, its schema, key)
             if isinstance(v, float) and _places(v) and not _integer_only(s)]
    if not found:
        return None
    places, where, value = max(found, key=lambda f: f[0])[:3]  # max keeps the first in document order
    for *_, s, k in found:
        s.pop(k, None)
    if not compiles(schema):
        return None
    return (f"invalid json_schema: {where} is {shorten(value)}, {places} decimal places, more than the engine can "
            f"bound a number with (its pattern for the range nests past its limit)")
