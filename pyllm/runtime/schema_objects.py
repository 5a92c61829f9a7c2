"""JSON-schema property counts (minProperties, maxProperties, required) as the constraint engine (llguidance) meets
them: on the object it generates, with the schema merged with its allOf members, its local "$ref" target and each
of its anyOf / oneOf branches (schema_walk.Merged), so a "required" in an allOf member counts toward a
minProperties beside it. Refused before the engine sees the schema: a minProperties that only keys the engine does
not keep distinct could meet; named by JSON pointer after the engine fails: a count it cannot generate or that no
object meets, which it reports without saying where."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .schema_walk import (SCHEMA_DATA, SCHEMA_MAPS, Merged, generated_subschemas, pointer, resolve_local,
                          typed_subschemas)

# (value, JSON pointer of the keyword) of a count bound
Count = tuple[int, str]


@dataclass(frozen=True)
class ObjectCounts:
    """What one way through a merged schema says about the properties of an object it admits."""

    required: frozenset = frozenset()  # the names "required" lists, from every member
    named: frozenset = frozenset()  # the names "properties" lists, from every member
    least: Count | None = None  # the largest minProperties, where it is written
    most: Count | None = None  # the smallest maxProperties, where it is written
    # the only keys admitted, or None for any: a member with additionalProperties false (and no
    # patternProperties) admits its own "properties" only, whatever the other members name
    allowed: frozenset | None = None
    is_object: bool = True  # False where a member's "type" leaves out "object": its counts do not apply

    def open(self) -> bool:
        """Whether the object admits keys the engine does not keep distinct (additionalProperties,
        patternProperties), beside its named and required ones."""
        return self.allowed is None


def _count(s: dict, key: str, path: str) -> Count | None:
    v = s.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
        return int(v), pointer(path, key)
    return None


def _names(v: Any) -> frozenset:
    if isinstance(v, dict):
        return frozenset(v)
    return frozenset(n for n in v if isinstance(n, str)) if isinstance(v, list) else frozenset()


# More ways through a schema (anyOf branches times anyOf branches) than this are not told apart: past it the
# ways are folded into one that has the largest minProperties, the fewest required names and any open object,
# so a minProperties that repeated keys could meet is still refused (a rare schema may be refused needlessly).
MAX_WAYS = 64


class _Counts(Merged):
    """Each subschema's ways through (a tuple of ObjectCounts, one per combination of anyOf / oneOf branches)."""

    anything = (ObjectCounts(),)

    def __init__(self, root: Any, paths: dict[int, str]):
        super().__init__(root)
        self.paths = paths

    def own(self, s: dict) -> tuple:
        path = self.paths.get(id(s), "")
        t = s.get("type")
        types = [t] if isinstance(t, str) else (t if isinstance(t, list) else None)
        named = _names(s.get("properties"))
        closed = s.get("additionalProperties") is False and not s.get("patternProperties")
        return (ObjectCounts(required=_names(s.get("required")), named=named,
                             least=_count(s, "minProperties", path), most=_count(s, "maxProperties", path),
                             allowed=named if closed else None, is_object=types is None or "object" in types),)

    def nothing(self) -> tuple:
        return ()

    def meet(self, a: tuple, b: tuple) -> tuple:
        ways = tuple(_meet(x, y) for x in a for y in b)
        return ways if len(ways) <= MAX_WAYS else (_fold(ways),)

    def join(self, branches: list) -> tuple:
        ways = tuple(w for ws in branches for w in ws)
        return ways if len(ways) <= MAX_WAYS else (_fold(ways),)


def _meet(a: ObjectCounts, b: ObjectCounts) -> ObjectCounts:
    least = max((c for c in (a.least, b.least) if c), default=None, key=lambda c: c[0])
    most = min((c for c in (a.most, b.most) if c), default=None, key=lambda c: c[0])
    allowed = b.allowed if a.allowed is None else a.allowed if b.allowed is None else a.allowed & b.allowed
    return ObjectCounts(a.required | b.required, a.named | b.named, least, most, allowed,
                        a.is_object and b.is_object)


def _fold(ways: tuple) -> ObjectCounts:
    objects = [w for w in ways if w.is_object] or list(ways)
    required = frozenset.intersection(*(w.required for w in objects))
    least = max((w.least for w in objects if w.least), default=None, key=lambda c: c[0])
    allowed = None if any(w.open() for w in objects) else frozenset().union(*(w.allowed for w in objects))
    return ObjectCounts(required, frozenset().union(*(w.named for w in objects)), least, None, allowed, True)


def object_counts(schema: Any):
    """(JSON pointer, ObjectCounts) for every way through every object the engine generates from ``schema``, in
    document order."""
    paths: dict[int, str] = {}
    for s, path, _ in typed_subschemas(schema):
        paths.setdefault(id(s), path)
    counts = _Counts(schema, paths)
    for s, path in generated_subschemas(schema):
        for way in counts.of(s):
            if way.is_object:
                yield path, way


def _unsatisfiable(way: ObjectCounts) -> bool:
    return way.most is not None and (way.least is not None and way.least[0] > way.most[0]
                                     or len(way.required) > way.most[0])


def repeated_key_refusal(schema: Any) -> str | None:
    """Why the engine could meet a minProperties of ``schema`` only by repeating a key, or None.

    llguidance keeps the named properties of an object distinct, but not the keys it admits through
    additionalProperties or patternProperties, and it counts minProperties over the keys as written: {"a": 1,
    "a": 2} passes minProperties 2, yet parses to one property. So an object whose minProperties is above the
    names it must have (its "required", wherever in the merge they are written) and that admits such keys is
    refused. A way through that no object meets (minProperties above maxProperties) is the engine's to drop."""
    for _, way in object_counts(schema):
        if way.least is not None and way.least[0] > len(way.required) and way.open() and not _unsatisfiable(way):
            least, at = way.least
            return (f"{at} is {least}, above the {len(way.required)} properties that object requires, on an "
                    f"object that admits additionalProperties or patternProperties: not supported, as the engine "
                    f"could meet it by repeating a key")
    return None


# The engine's refusals of a property count, none of which says where the count is
_COUNT_REFUSALS = re.compile(r"minProperties > maxProperties|required > maxProperties|"
                             r"minProperties \(\d+\) is greater than number of properties|"
                             r"min/maxProperties only supported when all keys listed")


def count_refusal(message: str, schema: Any) -> str | None:
    """One line naming the JSON pointer of the property count the engine's ``message`` refuses without saying
    where, or None if ``message`` is not such a refusal (or no count in ``schema`` fits it)."""
    m = _COUNT_REFUSALS.search(message)
    if m is None:
        return None
    what = m.group(0)
    for _, way in object_counts(schema):
        most = way.most
        if what.startswith("minProperties >") and way.least and most and way.least[0] > most[0]:
            return (f"{way.least[1]} is {way.least[0]}, above {most[1]} ({most[0]}): no object has both, so the "
                    f"schema admits no value")
        if what.startswith("required >") and most and len(way.required) > most[0]:
            return (f"{most[1]} is {most[0]}, but the object requires {len(way.required)} properties "
                    f"({', '.join(sorted(map(repr, way.required))[:4])}): the schema admits no value")
        names = way.named | way.required
        if what.startswith(("minProperties (", "min/max")) and way.least and not way.open() \
                and way.least[0] > len(way.allowed):
            return (f"{way.least[1]} is {way.least[0]}, but additionalProperties false (as written, or absent, "
                    f"which reads as false) leaves the object only {len(way.allowed)} names it may have: the schema "
                    f"admits no value")
        if what.startswith("min/max") and names - way.required:
            # the engine's rule: with a name that is not required, a count above the required names is kept only
            # as "at least one" or "at most one" of a closed object's names
            above = way.least[0] - len(way.required) if way.least else 0
            beyond = most[0] - len(way.required) if most else None
            if (above > 0 or beyond is not None) and not (above <= 1 and beyond in (None, 1) and not way.open()):
                at = way.least if above > 0 else most
                return (f"{at[1]} is {at[0]}: the engine bounds the number of properties only where every name "
                        f"in \"properties\" is required, or as a minProperties or maxProperties of 1 (one "
                        f"above the required names) with additionalProperties false")
    return None


# Keywords whose subschemas the output is not matched against as written (negated, conditional, applied to some
# keys or to key names only): an object there keeps JSON Schema's own default, extra keys allowed
_AS_WRITTEN = frozenset(["not", "if", "then", "else", "dependentSchemas", "propertyNames", "x-guidance"])


def close_objects(schema: dict) -> int:
    """Reads a missing "additionalProperties" as false, as llama.cpp's json-schema-to-grammar does (and so Ollama
    and llama-cpp-python): in place, every subschema that lists "properties" and says nothing of
    additionalProperties (nor unevaluatedProperties) gets "additionalProperties": false; "true" or a schema there
    still admits other keys, and an object without "properties" ({"type": "object"}) stays any object. JSON
    Schema's default (true) let a model invent keys until max_tokens, and a pydantic model's schema, which never
    writes it, failed to validate against the model where it validates with the peers.

    Objects whose "properties" come from more than one subschema merged together (allOf members, a "$ref" beside
    "properties", "properties" beside anyOf / oneOf branches that have their own) are left open: closing each
    part would admit only that part's names and reject the others' (llama.cpp merges such parts into one closed
    object, which JSON Schema cannot say without unevaluatedProperties). A definition referenced from such a
    place stays open everywhere. Returns how many objects were closed."""
    nodes: list[dict] = []  # every subschema the output is matched against as written
    stack: list[Any] = [schema]
    while stack:
        s = stack.pop()
        if isinstance(s, list):
            stack.extend(s)
            continue
        if not isinstance(s, dict):
            continue
        nodes.append(s)
        for k, v in s.items():
            if k in SCHEMA_DATA or k in _AS_WRITTEN:
                continue
            if k in SCHEMA_MAPS and isinstance(v, dict):
                stack.extend(v.values())
            elif isinstance(v, (dict, list)):
                stack.append(v)
    # union-find over the subschemas merged as one object: a schema with its allOf members and its "$ref" target
    parent = {id(s): id(s) for s in nodes}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(a: Any, b: Any) -> None:
        if isinstance(b, dict) and id(b) in parent:
            parent[find(id(a))] = find(id(b))

    for s in nodes:
        members = s.get("allOf")
        for m in members if isinstance(members, list) else ():
            union(s, m)
        if isinstance(s.get("$ref"), str):
            union(s, resolve_local(schema, s["$ref"]))
    named = [s for s in nodes if isinstance(s.get("properties"), dict)]
    count: dict[int, int] = {}
    for s in named:
        count[find(id(s))] = count.get(find(id(s)), 0) + 1
    merged = {root for root, n in count.items() if n > 1}
    for s in nodes:  # each branch is merged with the schema that holds it, not with the other branches
        if count.get(find(id(s))):
            for key in ("anyOf", "oneOf"):
                branches = s.get(key)
                for b in branches if isinstance(branches, list) else ():
                    if isinstance(b, dict) and id(b) in parent and count.get(find(id(b))) \
                            and find(id(b)) != find(id(s)):
                        merged |= {find(id(s)), find(id(b))}
    closed = 0
    for s in named:
        if find(id(s)) not in merged and "additionalProperties" not in s and "unevaluatedProperties" not in s:
            s["additionalProperties"] = False
            closed += 1
    return closed
