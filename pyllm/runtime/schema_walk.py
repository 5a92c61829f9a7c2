"""Walking a JSON schema the way the constraint engine (llguidance) applies it: every subschema, with its JSON
pointer and the types its keywords apply to. The engine merges a schema with its allOf members, its local "$ref"
target and each of its anyOf / oneOf branches before it applies a keyword such as a bound, so a bound's type may
come from any of those (or from a type list) rather than from the "type" beside it:
{"allOf": [{"type": "integer"}], "minimum": 2^53 + 1} bounds integers, as {"type": "integer", "minimum": ...} does.
Nothing is fetched: a reference that is not a JSON pointer into the schema itself adds no type."""

from __future__ import annotations

from typing import Any, Iterator

# Keywords whose values are data, not schemas; and those whose values map names (not keywords) to subschemas
SCHEMA_DATA = frozenset(["const", "enum", "default", "examples"])
SCHEMA_MAPS = frozenset(["properties", "patternProperties", "$defs", "definitions", "dependentSchemas"])
# Keywords whose subschemas the engine merges with the schema that holds them (a branch is merged with it too)
_MERGED = ("allOf", "anyOf", "oneOf")

# Every type a schema without "type" admits. "number" stands for every number, integers included, as in JSON
# Schema: it met with "integer" is "integer", and a set holding both is a type list the engine bounds both ways
ANY_TYPE = frozenset(["null", "boolean", "object", "array", "string", "number"])
_MERGING = frozenset(_MERGED + ("$ref",))
_TYPED = _MERGING | {"type"}
# How many allOf / anyOf / oneOf / "$ref" steps deep a schema's types are looked for; past it (or around a
# reference cycle) a schema is taken to admit any type, so its bounds keep the engine's number rules
MAX_TYPE_DEPTH = 64


def pointer(path: str, key) -> str:
    """The JSON pointer (RFC 6901) ``path`` extended by ``key``, escaped."""
    return f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"


def resolve_local(root: Any, ref: str):
    """The subschema a local reference ("#", "#/$defs/A") points to in ``root``, or None (not local, or absent)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def meet(a: frozenset, b: frozenset) -> frozenset:
    """The types both ``a`` and ``b`` admit."""
    if a is ANY_TYPE or a == b:
        return b
    if b is ANY_TYPE:
        return a
    both = a & b
    if ("integer" in a and "number" in b) or ("number" in a and "integer" in b):
        both |= {"integer"}
    return frozenset(both)


def numeric(types: frozenset) -> frozenset:
    """How the engine bounds a schema of ``types``: {"integer"} as 64-bit integers, {"number"} as decimals from
    64-bit floats, both for a type list with both, none for a schema no number meets."""
    return types & {"integer", "number"}


class Merged:
    """What each subschema of one root amounts to once merged as the engine merges it: its own value (``own``)
    met with those of its allOf members and its local "$ref" target, then with the join of its anyOf / oneOf
    branches (each branch is merged with the schema that holds it). Subclasses give ``own``, ``meet``, ``join``
    and ``anything`` (what a schema with no keywords amounts to); memoised per subschema."""

    anything: Any = None

    def __init__(self, root: Any):
        self.root = root
        self.memo: dict[int, Any] = {}
        self.targets: dict[str, Any] = {}

    def own(self, s: dict) -> Any:
        raise NotImplementedError

    def meet(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def join(self, branches: list) -> Any:
        raise NotImplementedError

    def nothing(self) -> Any:
        """What the schema false amounts to."""
        return self.anything

    def target(self, ref: Any):
        """The dict a local reference points to, or None; each reference resolved once."""
        if not isinstance(ref, str):
            return None
        if ref not in self.targets:
            found = resolve_local(self.root, ref)
            self.targets[ref] = found if isinstance(found, dict) else None
        return self.targets[ref]

    def of(self, s: Any, depth: int = 0, chain: frozenset = frozenset()) -> Any:
        """What ``s`` amounts to. Each subschema is computed once (a schema of many references stays linear);
        one reached past the depth bound or around a cycle amounts to ``anything``, and what is computed through
        it keeps that."""
        if s is False:
            return self.nothing()
        if not isinstance(s, dict):
            return self.anything
        known = self.memo.get(id(s))
        if known is not None:
            return known
        out = self.own(s)
        if _MERGING.isdisjoint(s):
            self.memo[id(s)] = out
            return out
        if depth > MAX_TYPE_DEPTH or id(s) in chain:
            return self.anything
        chain |= {id(s)}
        members = s.get("allOf")
        target = self.target(s.get("$ref"))
        for m in (members if isinstance(members, list) else []) + ([target] if target is not None else []):
            out = self.meet(out, self.of(m, depth + 1, chain))
        for key in ("anyOf", "oneOf"):
            branches = s.get(key)
            if isinstance(branches, list) and branches:
                out = self.meet(out, self.join([self.of(b, depth + 1, chain) for b in branches]))
        self.memo[id(s)] = out
        return out


class _Types(Merged):
    """The types each subschema of one root admits, its own met with those it is merged with."""

    anything = ANY_TYPE

    def __init__(self, root: Any):
        super().__init__(root)
        self.named: dict[str, frozenset] = {}  # one set per type name: meet's identity test finds them equal

    def own(self, s: dict) -> frozenset:
        t = s.get("type")
        if isinstance(t, str):
            return self.named.setdefault(t, frozenset([t]))
        return ANY_TYPE if not isinstance(t, list) else frozenset(n for n in t if isinstance(n, str))

    def nothing(self) -> frozenset:
        return frozenset()

    def meet(self, a: frozenset, b: frozenset) -> frozenset:
        return meet(a, b)

    def join(self, branches: list) -> frozenset:
        # a wider set of types only keeps the engine's number rules on a bound as well
        return frozenset().union(*branches)


def generated_subschemas(root: Any) -> Iterator[tuple[dict, str]]:
    """(subschema, its JSON pointer) for the root and every subschema the engine generates a value from on its
    own, in document order: property, item, additionalProperties ... values, not the allOf / anyOf / oneOf members
    and "$ref" targets it merges into the schema that holds them (Merged.of gives what those amount to), nor
    $defs entries, which it generates only where they are referenced. Iterative."""
    stack: list[tuple[Any, str, bool]] = [(root, "", True)]
    while stack:
        s, path, generated = stack.pop()
        if isinstance(s, list):
            stack.extend((v, pointer(path, i), generated) for i, v in reversed(list(enumerate(s))))
            continue
        if not isinstance(s, dict):
            continue
        if generated:
            yield s, path
        children: list[tuple[Any, str, bool]] = []
        for k, v in s.items():
            if k in SCHEMA_DATA or k == "$ref":
                continue
            if k in SCHEMA_MAPS and isinstance(v, dict):
                children += [(x, pointer(pointer(path, k), name), k not in ("$defs", "definitions"))
                             for name, x in v.items()]
            elif isinstance(v, (dict, list)):
                children.append((v, pointer(path, k), k not in _MERGED))
        stack.extend(reversed(children))


def typed_subschemas(root: Any) -> Iterator[tuple[dict, str, frozenset]]:
    """(subschema, its JSON pointer, the types its keywords apply to) for every subschema of ``root`` in document
    order, a "$ref" target also where it is referenced. A subschema is given again for each other set of types it
    is merged with (a definition referenced from an integer schema and from a number schema), always at the
    pointer where it is written (for a target, the reference's own pointer). Iterative over positions; the types
    are looked for at most MAX_TYPE_DEPTH merges deep."""
    types = _Types(root)
    seen: set[tuple[int, frozenset]] = set()
    stack: list[tuple[Any, str, frozenset]] = [(root, "", ANY_TYPE)]
    while stack:
        s, path, outer = stack.pop()
        if isinstance(s, list):
            stack.extend((v, pointer(path, i), ANY_TYPE) for i, v in reversed(list(enumerate(s))))
            continue
        if not isinstance(s, dict):
            continue
        # most subschemas have none of the keywords that bring types: they apply to what they are merged into
        here = meet(outer, types.of(s)) if not _TYPED.isdisjoint(s) else outer
        if (id(s), here) in seen:
            continue
        seen.add((id(s), here))
        yield s, path, here
        children: list[tuple[Any, str, frozenset]] = []
        for k, v in s.items():
            if k in SCHEMA_DATA:
                continue
            if k in _MERGED and isinstance(v, list):
                children += [(m, pointer(pointer(path, k), i), here) for i, m in enumerate(v)]
            elif k == "$ref":
                target = types.target(v)
                if target is not None:
                    children.append((target, v[1:], here))
            elif k in SCHEMA_MAPS and isinstance(v, dict):
                children += [(x, pointer(pointer(path, k), name), ANY_TYPE) for name, x in v.items()]
            elif isinstance(v, (dict, list)):
                children.append((v, pointer(path, k), ANY_TYPE))
        stack.extend(reversed(children))
