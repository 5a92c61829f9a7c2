"""JSON-schema numbers the constraint engine (llguidance) would change or cannot compile, caught before it sees
the schema: integer consts and enums it would round, integer bounds and number bounds past 2^53 moved inwards to
values it keeps exactly, and number bounds it cannot write refused naming their JSON pointer
(pyllm/runtime/constraint.py compiles the rest). A bound follows its schema's effective type (schema_walk.py)."""

from __future__ import annotations

import math
import re
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any

from ..errors import PyllmError, shorten
from .schema_walk import SCHEMA_DATA, numeric, pointer, typed_subschemas

# The engine reads a schema's numbers as 64-bit floats and integer bounds as 64-bit integers: an integer past 2^53
# may come out rounded, and a bound at or past +-2^63 fails to compile or is cut to 2^63 - 1. Within +-BOUND_EDGE
# (the largest double below 2^63) every double is an integer bound it keeps exactly.
BOUND_EDGE = 2 ** 63 - 1024
OPEN_RANGE_LIMIT = 10 ** 18
# The most digits in a row a number's integral part, fraction or exponent may have under a JSON schema, as llama.cpp's
# json-schema-to-grammar writes them ([0] | [1-9] [0-9]{0,15}; [0-9]{1,16}): the engine's numbers are unbounded, and
# a small sampled model can write digits until max_tokens. A schema whose own numbers need more digits raises it.
NUMBER_DIGITS = 16
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum")


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


def bound_kinds(schema: Any) -> dict[int, tuple[dict, str, set]]:
    """id of each subschema -> (it, its JSON pointer, how the engine bounds it: {"integer"}, {"number"}, both, or
    none), over every place it is merged into; in document order. The type is the schema's effective one
    (schema_walk): {"allOf": [{"type": "integer"}], "minimum": 2^53 + 1} is bounded as integers, and a definition
    referenced from an integer schema and from a number schema both ways."""
    kinds: dict[int, tuple[dict, str, set]] = {}
    for s, path, types in typed_subschemas(schema):
        kinds.setdefault(id(s), (s, path, set()))[2].update(numeric(types))
    return kinds


def _refuse_rounded_data(s: dict, path: str) -> None:
    """PyllmError naming the first integer in ``s``'s const or enum the engine would write as another number."""
    for k in ("const", "enum"):
        if k not in s:
            continue
        data = [(s[k], pointer(path, k))]
        while data:
            d, at = data.pop()
            if isinstance(d, dict):
                data.extend((x, pointer(at, i)) for i, x in reversed(list(d.items())))
            elif isinstance(d, list):
                data.extend((x, pointer(at, i)) for i, x in reversed(list(enumerate(d))))
            elif isinstance(d, int) and not isinstance(d, bool) and _as_written(d) != str(d):
                raise PyllmError(f"invalid json_schema: {at or '/'} is {shorten(d)}, which the engine would "
                                 f"write as {shorten(_as_written(d))} (it keeps numbers as 64-bit floats, "
                                 f"exact for integers up to 2^53); give it as a string")


def exact_integers(schema: Any) -> Any:
    """``schema`` with its integer bounds moved to the nearest value the engine keeps exactly, inwards (a
    minimum of 2^53 + 1 becomes 2^53 + 2, a maximum of 2^64 becomes BOUND_EDGE: the range can only narrow, never
    admit a value the schema refuses), and the number bounds it would read as a value outside them likewise
    (_number_bound), or None if none needs to move; edited in place. A bound's type is its schema's effective one
    (bound_kinds), wherever the schema sits. PyllmError naming the value and where it is for an integer in a
    const or enum the engine would write as another number, and for an integer bound that leaves no integer it
    can write (a minimum above BOUND_EDGE). Iterative: a schema may nest deeply."""
    kinds = bound_kinds(schema)
    for s, path, _ in kinds.values():
        _refuse_rounded_data(s, path)
    changed = _parse_safe_number_bounds(schema, kinds)
    for s, path, how in kinds.values():
        # the inclusive bounds first: an exclusive one made inclusive is then met with their final value
        for k in _LOWER_BOUNDS[:1] + _UPPER_BOUNDS[:1] + _LOWER_BOUNDS[1:] + _UPPER_BOUNDS[1:]:
            v = s.get(k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not (isinstance(v, int) or v.is_integer()):
                continue
            if how == {"integer"}:
                changed |= _integer_bound(s, path, k, v)
            elif "number" in how:
                changed |= _number_bound(s, k, int(v), "integer" in how)
    return schema if changed else None


def _parse_safe_number_bounds(schema: Any, kinds: dict[int, tuple[dict, str, set]]) -> bool:
    """Makes each exclusive bound of a schema bounded as numbers that a written decimal could meet only once read
    as a double the inclusive bound at the next double inwards, and writes each float bound so that the engine
    reads it exactly (_read_as_given); whether any changed.

    The engine compares the decimal text it writes with the bound exactly, but a JSON reader makes a double of a
    number with a fraction: under an exclusiveMaximum of -3e17, -300000000000000000.5 is below the bound, and
    Python's json reads it as -3e17, the bound itself (under an exclusiveMinimum of 0.1 with 18 places allowed,
    0.100000000000000001 reads as 0.1). An inclusive bound has no such text: reading is monotonic, so a decimal
    at or inside the bound's double reads as a double at or inside it. So an exclusive bound becomes the
    inclusive bound at the next double inwards: every double the schema admits is still admitted, and the only
    decimals left out are those that read as the bound or as that next double (written shorter). Integer text
    reads exactly, but the engine's range cannot tell it from a fraction, so integers within one step of the
    double of a bound past 2^53 are left out too (as integer bounds there move, the range only narrows). Only a
    bound that text within the digit cap (number_digit_cap) can come within one step of is moved: an
    exclusiveMinimum of 0 stays, since 5e-324 needs more places than any number may have. The cap grows with the
    schema's numbers, a moved bound's among them, so the bounds are looked at again until none moves."""
    changed = True
    moved_any = False
    while changed:
        changed = False
        step = 10.0 ** -number_digit_cap(schema)  # the smallest fraction a number may have
        for s, _, how in kinds.values():
            if "number" not in how:
                continue
            for k in ("exclusiveMinimum", "exclusiveMaximum"):
                v = s.get(k)
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    continue
                try:
                    f = float(v)
                except OverflowError:  # past any double: number_bound_refusal names it
                    continue
                if not math.isfinite(f) or math.ulp(f) < step:
                    continue
                lower = k == "exclusiveMinimum"
                # the nearest double to v is inside it when v (an integer past 2^53) is not a double itself
                inside = f if (f > v if lower else f < v) else math.nextafter(f, math.inf if lower else -math.inf)
                key, bound = _inclusive(s, k, inside)
                # a bound past 2^53 is an integer: written as one, _number_bound then moves it to where the
                # engine reads it inwards
                s[key] = int(bound) if isinstance(bound, float) and abs(bound) >= 2 ** 53 else bound
                changed = moved_any = True
        for s, _, how in kinds.values():
            if "number" in how:
                for k in _LOWER_BOUNDS + _UPPER_BOUNDS:
                    changed |= _read_as_given(s, k)
        moved_any |= changed
    return moved_any


# The engine reads a bound's JSON digits as one integer made a double, then scaled by a power of ten: exact where
# that integer is a double (below 2^53 always), but two roundings where it is not (0.9999999999999999 was read as
# 1, and a maximum of it admitted 1). A float bound whose digits are no double is written as the integer it is, or
# else moved inwards to the nearest double whose shortest digits are one (0.9999999999999998): the range narrows
# by a double or so, and every value it admits reads, as Python's json reads it, as a double inside the bound.
_READ_EXACT_STEPS = 64


def _exact_digits(v: float) -> bool:
    """Whether the digits JSON writes for ``v``, taken as one integer, are a double (the engine's first rounding
    keeps them)."""
    digits = int("".join(map(str, Decimal(repr(v)).as_tuple().digits)))
    return int(float(digits)) == digits


def _read_as_given(s: dict, k: str) -> bool:
    """Writes the float bound ``s[k]`` so that the engine reads it exactly, moving it inwards where it must;
    whether it changed. From 2^53 a bound is written as an integer already (_number_bound)."""
    v = s.get(k)
    if not isinstance(v, float) or not math.isfinite(v) or abs(v) >= 2 ** 53 or _exact_digits(v):
        return False
    if v.is_integer():
        s[k] = int(v)
        return True
    inwards = math.inf if k in _LOWER_BOUNDS else -math.inf
    moved = v
    for _ in range(_READ_EXACT_STEPS):  # about one double in two or three has such digits
        moved = math.nextafter(moved, inwards)
        if _exact_digits(moved):
            break
    else:  # 15 significant digits are always exact
        written = Decimal(repr(v))
        moved = float(written.quantize(Decimal(1).scaleb(written.adjusted() - 14),
                                       rounding=ROUND_CEILING if inwards > 0 else ROUND_FLOOR))
    s[k] = int(moved) if moved.is_integer() else moved
    return True


def _integer_bound(s: dict, path: str, k: str, given: int | float) -> bool:
    """Moves (or refuses) the bound ``s[k]`` of a schema bounded as integers only; whether ``s`` changed."""
    # a bound spelled as a float (1e19) is the integer it equals: the engine saturates it to 2^63 - 1, or fails
    # on it, as it does the integer spelling, so it is moved or refused the same way
    v, changed = int(given), False
    lower = k in _LOWER_BOUNDS
    edge = BOUND_EDGE - k.startswith("exclusive")
    if (v > edge) if lower else (v < -edge):
        raise PyllmError(f"invalid json_schema: {pointer(path, k)} is {shorten(given)}, beyond the "
                         f"integers the engine can bound (-{BOUND_EDGE}..{BOUND_EDGE})")
    exact = _inwards(v, lower)
    if (exact != v or abs(v) >= 2 ** 53) and k.startswith("exclusive"):
        # rounded inwards, the bound could pass the one integer left (exclusiveMinimum 2^63 - 1025 moved to
        # 2^63 - 1024 excludes it): as an inclusive bound, the next integer on rounds instead. Kept, from 2^53 up
        # it is stepped past in floats by the engine, where 2^53 + 1 is 2^53: an exclusiveMinimum of 2^53 (or
        # 9.2e18) admitted the bound itself
        k, exact = _inclusive(s, k, _inwards(v + 1 if lower else v - 1, lower))
        changed = True
    # written as the integer even where it keeps its value: the engine steps past a float exclusive bound in
    # floats, and 9.2e18 + 1 is 9.2e18, so an exclusiveMinimum of 9.2e18 admitted 9.2e18
    if exact != s.get(k) or isinstance(s.get(k), float):
        s[k] = exact
        changed = True
    # the engine cannot write an open-ended range from 10^18 up (or down from -10^18): it fails to compile one,
    # so the far end is given as the edge, which no integer it writes passes anyway
    if abs(v) >= OPEN_RANGE_LIMIT and (v > 0) == lower \
            and not any(b in s for b in (_UPPER_BOUNDS if lower else _LOWER_BOUNDS)):
        s["maximum" if lower else "minimum"] = BOUND_EDGE if lower else -BOUND_EDGE
        changed = True
    return changed


def _inclusive(s: dict, k: str, bound: int) -> tuple[str, int]:
    """The exclusive bound ``s[k]`` dropped for the inclusive ``bound``: (the inclusive key, the bound met with
    the inclusive one ``s`` already has)."""
    lower = k in _LOWER_BOUNDS
    del s[k]
    k = _LOWER_BOUNDS[0] if lower else _UPPER_BOUNDS[0]
    old = s.get(k)
    if isinstance(old, (int, float)) and not isinstance(old, bool):
        bound = max(old, bound) if lower else min(old, bound)
    return k, bound


def _number_bound(s: dict, k: str, v: int, both: bool) -> bool:
    """Moves the integral bound ``s[k]`` (equal to ``v``) of a schema bounded as numbers (``both``: and as
    integers, a type list with both) inwards to where the engine reads it as keeping ``v``; whether it moved.

    The engine writes a number range as decimals from the shortest digits of the bound's nearest double
    (_as_written): from 2^53 in magnitude that can be a value outside the bound (a minimum of 2^53 + 1 is read as
    2^53 and admitted 2^53; a maximum of 2^62 - 1 admitted 4611686018427388000). The bound moves to the nearest
    such reading inwards, as the integer path moves an integer bound: the range only narrows, by less than the
    double's step, and a compilable schema is not refused. The integer side of a type list reads the double
    itself and steps past an exclusive bound in floats, so there the bound must keep both readings. A moved
    exclusive bound becomes the inclusive one it was moved to (past the bound, that value is admitted too).
    Bounds the engine cannot write (past BOUND_EDGE as it reads them) are left for number_bound_refusal to name;
    one that ends an open range from 10^18 moves too (the range may be closed by a schema merged with this one),
    and if the engine fails on it, number_bound_refusal names it as given."""
    lower = k in _LOWER_BOUNDS
    exclusive = both and k.startswith("exclusive")
    if not 2 ** 53 <= abs(v) <= BOUND_EDGE or abs(int(_as_written(v))) > BOUND_EDGE:
        return False
    d = float(v)
    for _ in range(4):  # a double or two on is always enough: each reading is within half a step of it
        readings = [int(_as_written(d))] + ([int(d)] if both else [])
        if all((r > v if exclusive else r >= v) if lower else (r < v if exclusive else r <= v) for r in readings):
            break
        d = math.nextafter(d, math.inf if lower else -math.inf)
    else:
        return False
    if d == float(v) and not exclusive:  # read inwards already
        return False
    written = int(_as_written(d))
    if k.startswith("exclusive"):  # moved past the bound, the value it now reads is admitted too
        k, written = _inclusive(s, k, written)
    s[k] = written
    return True


def number_digit_cap(schema: Any) -> int:
    """NUMBER_DIGITS, or more where the schema's own numbers (bounds, const, enum, ...) need more digits in a row:
    one past the longest integral part or fraction among them, so that a value just past an exclusive bound is
    still expressible. Iterative: a schema may nest deeply."""
    cap = NUMBER_DIGITS
    stack = [schema]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            whole, _, fraction = format(Decimal(repr(v) if isinstance(v, float) else v), "f").lstrip("-").partition(".")
            cap = max(cap, len(whole) + 1, len(fraction) + 1)
    return cap


# The engine writes a bounded number (not integer) as plain decimals, splitting its range at 0 and, for a range
# open on one side, at the next power of ten past the bound, and parses each piece's integral ends as a 64-bit
# integer: a bound of magnitude 2^63 or more (past BOUND_EDGE, as doubles go) fails, and so does a minimum of 10^18
# or more with no maximum (or a maximum of -10^18 or less with no minimum), whose next power of ten is 10^19. It
# says so naming only the range ("Failed to generate regex for float range: min=None, max=Some(1e19)"), and it
# reads a bound's digits with rounding of its own (9.223372036854775e18, BOUND_EDGE, is its 2^63). No bound
# can be dropped or moved instead: the digits a number may have grow with the schema's own numbers (number_digit_cap),
# so values past the bound stay writable and a changed bound would admit or refuse some.
_FLOAT_RANGE = re.compile(r"Failed to generate regex for (float|integer) range: min=(?:None|Some\(([^)]*)\)), "
                          r"max=(?:None|Some\(([^)]*)\))")


def _bounds(schema: Any):
    """(its schema, JSON pointer, key, value) of each numeric bound in ``schema``, in document order."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        s, path = stack.pop()
        if isinstance(s, list):
            stack.extend((v, pointer(path, i)) for i, v in reversed(list(enumerate(s))))
        elif isinstance(s, dict):
            for k, v in list(s.items()):
                if k in _LOWER_BOUNDS + _UPPER_BOUNDS and isinstance(v, (int, float)) and not isinstance(v, bool):
                    yield s, pointer(path, k), k, v
            stack.extend((v, pointer(path, k)) for k, v in reversed(list(s.items()))
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
                where, best, given, key = at, abs(f - value), v, k
    if where is None or best > abs(value) * 1e-9:
        return f"invalid json_schema: a number {'minimum' if lower else 'maximum'} is {value!r}, {why}"
    # an exclusive bound the engine got one double inwards was moved there (_parse_safe_number_bounds), not
    # misread
    moved = key.startswith("exclusive") and (value > float(given) if lower else value < float(given))
    read = "" if float(given) == value or saturates or moved else f" (read by the engine as {value!r})"
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
    # an integer bound is no range pattern: only bounds that some place bounds as numbers count
    numbers = {i for i, (_, _, how) in bound_kinds(schema).items() if how != {"integer"}}
    found = [(_places(v), at, v, s, k) for s, at, k, v in _bounds(schema)  # (places, pointer, value, its schema, key)
             if isinstance(v, float) and _places(v) and id(s) in numbers]
    if not found:
        return None
    places, where, value = max(found, key=lambda f: f[0])[:3]  # max keeps the first in document order
    for *_, s, k in found:
        s.pop(k, None)
    if not compiles(schema):
        return None
    return (f"invalid json_schema: {where} is {shorten(value)}, {places} decimal places, more than the engine can "
            f"bound a number with (its pattern for the range nests past its limit)")
