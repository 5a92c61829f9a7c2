"""Structured output: JSON schema, JSON object and GBNF constraints on the fixture models.

References: every constrained output must validate with the ``jsonschema`` package (or parse under the GBNF's
own shape, checked with a Python regex of the same language); exact checks for the mask (disallowed ids -inf,
allowed ones untouched) and for the vocabulary bridge (the tokenizer's own bytes for every id).
"""

import copy
import functools
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")  # in the test extra; CI installs it

from conftest import pyllm_model  # noqa: E402
from pyllm import PyllmError  # noqa: E402
from pyllm.errors import shorten  # noqa: E402
from pyllm.runtime.constraint import Constraint, make_constraint  # noqa: E402
from pyllm.runtime.sampler import Sampler, SamplerSettings  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"], "additionalProperties": False,
}
TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1,
                            "maxItems": 3},
                   "score": {"type": "number", "minimum": 0, "maximum": 10},
                   "ok": {"type": "boolean"}},
    "required": ["tags", "score", "ok"], "additionalProperties": False,
}
INTS_GBNF = 'root ::= "[" num ("," " "? num){0,4} "]"\nnum ::= "-"? [0-9]{1,3}\n'
INTS_RE = re.compile(r"\[-?[0-9]{1,3}(, ?-?[0-9]{1,3}){0,4}\]")


def llm_of(key):
    return pyllm_model(key, n_ctx=512)


def chat(llm, schema, **kw):
    msgs = [{"role": "user", "content": "Invent a user record and answer in JSON only."}]
    return llm.chat(msgs, max_tokens=96, json_schema=schema, **kw)


def check_complete(llm, text, schema):
    assert llm.stats.finish_reason == "eog", (llm.stats.finish_reason, text)
    jsonschema.validate(json.loads(text), schema)


# ---- the vocabulary bridge ----------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["smollm2", "qwen2", "gemma3"])
def test_bridge_accepts_the_tokenizers_own_encoding(key):
    """A grammar that is exactly one literal text must accept, token by token, the tokenizer's encoding of that
    text (multi-byte UTF-8, byte-fallback tokens for gemma3's rare characters, spaces, newlines) and then allow
    only end-of-generation ids."""
    llm = llm_of(key)
    text = 'naïve café — 日本語 \U0001f600 "q"\n\ttabs  {x}'
    gbnf = "root ::= " + json.dumps(text, ensure_ascii=False)  # GBNF escapes: \n \t \" as JSON writes them
    c = llm.make_constraint(grammar=gbnf)
    ids = llm.tokenize(text, add_bos=False, special=False)
    assert llm.detokenize(ids) == text
    for t in ids:
        assert c.allowed()[t], (t, llm.tokenizer.token_bytes(t))
        c.advance(t)
    assert c.is_done()
    left = set(np.flatnonzero(c.allowed()).tolist())
    assert left and left <= set(llm.tokenizer.eog_ids), left


def test_bridge_vocab_is_built_once_and_covers_padding():
    llm = llm_of("qwen2")  # its output layer has more rows than the vocabulary has tokens
    v = llm.grammar_vocab
    assert llm.grammar_vocab is v
    assert v.n_vocab == llm.n_vocab >= llm.tokenizer.n_vocab
    assert v.eos_ids[0] == llm.tokenizer.eos_id and set(v.eos_ids) == set(llm.tokenizer.eog_ids)
    c = llm.make_constraint(json_schema={"type": "object"})
    assert not c.allowed()[llm.tokenizer.n_vocab:].any()  # padding rows never allowed


# ---- mask, sampler chain ------------------------------------------------------------------------------------
def test_mask_in_place_and_never_empty():
    """mask() sets exactly the disallowed ids to -inf (torch and numpy alike) and keeps the others; along a
    valid document the mask is never empty, and at the end it holds only end-of-generation ids."""
    llm = llm_of("smollm2")
    doc = {"name": "Ada", "age": 36, "role": "admin", "address": {"city": "London", "zip": "12345"}}
    ids = llm.tokenize(json.dumps(doc), add_bos=False, special=False)
    c = llm.make_constraint(json_schema=PERSON)
    rng = np.random.default_rng(0)
    for t in ids:
        allowed = c.allowed()
        assert allowed.any()
        lg = torch.from_numpy(rng.standard_normal(llm.n_vocab).astype(np.float32))
        ref = lg.clone()
        out = c.mask(lg)
        assert out is lg
        assert torch.isneginf(lg[torch.from_numpy(~allowed)]).all()
        assert torch.equal(lg[torch.from_numpy(allowed)], ref[torch.from_numpy(allowed)])
        ln = ref.numpy().copy()
        c.mask(ln)
        assert np.array_equal(ln, lg.numpy())
        c.advance(t)
    assert c.is_done()
    assert set(np.flatnonzero(c.allowed()).tolist()) <= set(llm.tokenizer.eog_ids)
    # whitespace is bounded (a sampled small model must not pad forever): indented JSON fits, blank lines do not
    for text, ok in (('{\n  "a": 1\n}', True), ('{"a":1}', True), ('{\n\n\n"a": 1}', False)):
        c = llm.make_constraint(json_schema={"type": "object"})
        assert all(c.allowed()[t] and (c.advance(t) or True)
                   for t in llm.tokenize(text, add_bos=False, special=False)) == ok, text


def test_sampler_masks_after_bias_and_before_greedy():
    """Greedy picks the best allowed id, whatever the logit bias does to disallowed ones; a bias on an allowed id
    counts (the mask applies after bias and penalties)."""
    llm = llm_of("smollm2")
    tok = llm.tokenizer
    brace = tok.encode("{", add_bos=False, special=False)
    assert len(brace) == 1
    logits = torch.zeros(llm.n_vocab)
    logits[tok.encode("Hello", add_bos=False, special=False)[0]] = 50.0  # the best token overall: not JSON
    c = llm.make_constraint(json_schema={"type": "object"})
    allowed = c.allowed().copy()
    s = Sampler(SamplerSettings(temperature=0, logit_bias={7: 100.0}), constraint=c)
    assert not allowed[7]
    t = s.sample(logits)
    assert allowed[t]
    # with a bias on one allowed id, that id wins
    pick = int(np.flatnonzero(allowed)[-1])
    c2 = llm.make_constraint(json_schema={"type": "object"})
    s2 = Sampler(SamplerSettings(temperature=0, logit_bias={pick: 100.0}), constraint=c2)
    assert s2.sample(logits) == pick
    # at temperature > 0, with top-k 40, every draw is allowed (top-k never fills with masked ids)
    for seed in range(5):
        c3 = llm.make_constraint(json_schema={"type": "object"})
        s3 = Sampler(SamplerSettings(temperature=1.5, top_k=40, top_p=1.0, min_p=0.0, seed=seed), constraint=c3)
        assert allowed[s3.sample(torch.randn(llm.n_vocab, generator=torch.Generator().manual_seed(seed)))]


# ---- generation on the fixtures -----------------------------------------------------------------------------
@pytest.mark.parametrize("schema", [PERSON, TAGS], ids=["person", "tags"])
def test_smollm2_schemas_greedy_and_sampled(schema):
    llm = llm_of("smollm2")
    check_complete(llm, chat(llm, schema, temperature=0), schema)
    for seed in (1, 2, 3):
        check_complete(llm, chat(llm, schema, temperature=0.8, seed=seed), schema)


def test_qwen2_schema_greedy_and_sampled():
    llm = llm_of("qwen2")
    check_complete(llm, chat(llm, PERSON, temperature=0), PERSON)
    check_complete(llm, chat(llm, TAGS, temperature=0.7, seed=5), TAGS)


def test_json_object_and_schema_as_text():
    llm = llm_of("smollm2")
    # "any object" leaves the length to the model: a prompt it can follow keeps the reply short enough to close.
    # From an empty cache: a prefix cached by an earlier test's prompt was evaluated in another batch shape, whose
    # last-bit differences can tip this reply's near-tie between closing and nesting one more object.
    llm.reset()
    out = llm.chat([{"role": "user", "content": 'Reply with the JSON object {"a": 1} and nothing else.'}],
                   max_tokens=48, temperature=0, constraint=llm.make_constraint(json_schema={"type": "object"}))
    assert isinstance(json.loads(out), dict) and llm.stats.finish_reason == "eog"
    text_schema = json.dumps({"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 2})
    out = llm.generate("Two letters: ", max_tokens=16, temperature=0, json_schema=text_schema)
    assert json.loads(out) in (["a", "a"], ["a", "b"], ["b", "a"], ["b", "b"])


def test_gbnf_list_of_ints():
    llm = llm_of("smollm2")
    for kw in (dict(temperature=0), dict(temperature=0.9, seed=4)):
        out = llm.generate("The first primes, as a list: ", max_tokens=32, grammar=INTS_GBNF, **kw)
        assert INTS_RE.fullmatch(out), out
        assert all(isinstance(x, int) for x in json.loads(out))
        assert llm.stats.finish_reason == "eog"


def test_generate_tokens_stops_when_complete():
    """Once the grammar is complete, the end-of-generation id follows at once (no decode step is spent on it)."""
    llm = llm_of("smollm2")
    ids = llm.tokenize("Answer: ")
    toks = list(llm.generate_tokens(ids, max_tokens=20, temperature=0, grammar='root ::= "yes" | "no"'))
    assert llm.detokenize(toks[:-1]) in ("yes", "no")
    assert toks[-1] == llm.tokenizer.eos_id and llm.tokenizer.is_eog(toks[-1])
    assert llm.stats.finish_reason == "eog"
    # the forced end id is not evaluated: the cache holds the prompt and the grammar's tokens only
    assert llm.generator.tokens == ids + toks[:-2]


# ---- errors -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, needle", [
    (dict(json_schema='{"type": "object",'), "not valid JSON"),
    (dict(json_schema={"type": "nope"}), "invalid json_schema"),
    (dict(json_schema={"type": "string", "pattern": "(("}), "unclosed group"),
    (dict(json_schema=[1, 2]), "must be a JSON object"),
    (dict(json_schema=False), "false"),
    (dict(grammar="root ::= foo"), "Rule 'foo' not found"),
    (dict(grammar='root ::= "a'), "invalid grammar"),
    (dict(grammar="   "), "non-empty"),
    # grammars no text can complete: were the engine's "NoExtensionBias Error: None" at the first step, or
    # "Too many items" (or max_tokens of output) once generation reached the rule
    (dict(grammar="root ::= root"), "invalid grammar: rule 'root' can never finish: every alternative refers back "
                                    "to itself, so the grammar matches no text"),
    (dict(grammar="root ::= a\na ::= root"), "rule 'root' can never finish: every alternative refers back to "
                                             "itself through 'a', so the grammar matches no text"),
    (dict(grammar='root ::= "x" root'), "rule 'root' can never finish"),
    (dict(grammar='root ::= "a" b | "c"\nb ::= b "x"'), "rule 'b' can never finish: every alternative refers "
                                                        "back to itself, and rule 'root' can reach it"),
    (dict(grammar="start: start"), "invalid grammar: it matches no text"),
    (dict(grammar="root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(998)) + "r998 ::= r0\n"),
     "rule 'r0' can never finish: every alternative refers back to itself through 'r1' -> 'r2' -> 995 more -> "
     "'r998', so the grammar matches no text"),
    (dict(json_schema={"type": "object"}, grammar='root ::= "a"'), "at most one"),
    # nesting that exhausts Python's recursive JSON parser and encoder: was a RecursionError traceback
    (dict(json_schema='{"items":' * 5000 + "{}" + "}" * 5000), "nests too deeply to parse"),
    (dict(json_schema=functools.reduce(lambda inner, _: {"items": inner}, range(5000), {})), "nests too deeply"),
])
def test_invalid_schema_or_grammar(kw, needle):
    llm = llm_of("smollm2")
    with pytest.raises(PyllmError, match=re.escape(needle)):
        list(llm.generate_tokens(llm.tokenize("x"), max_tokens=2, **kw))


def test_grammars_whose_rules_can_finish_are_accepted():
    llm = llm_of("smollm2")
    for g in ('root ::= "x" | root', 'root ::= ("x" root)?', 'root ::= a "!"\na ::= "a" a | "b"\nunused ::= unused'):
        assert llm.make_constraint(grammar=g).allowed().any(), g


def accepts(llm, schema, text, constraint=None) -> bool:
    """Whether the constraint for ``schema`` (or ``constraint``) takes ``text`` (as the tokenizer splits it) as a
    complete output."""
    c = constraint or llm.make_constraint(json_schema=schema)
    for t in llm.tokenize(text, add_bos=False, special=False):
        if not c.allowed()[t]:
            return False
        c.advance(t)
    return c.is_accepting()


def test_min_properties_that_repeated_keys_could_fake_is_refused():
    """The engine keeps named properties distinct but not the keys additionalProperties / patternProperties admit,
    and counts minProperties over the keys as written: {"a": 1, "a": 2} would pass, and jsonschema (the reference)
    rejects what it parses to. Such schemas are refused by name; minProperties the required names already meet
    stays, and what it lets through validates."""
    llm = llm_of("smollm2")
    for schema, where, required in (
            ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, "/minProperties", 0),
            ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "minProperties": 2,
              "additionalProperties": True}, "/minProperties", 1),
            ({"type": "array", "items": {"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                                         "additionalProperties": False, "minProperties": 2}},
             "/items/minProperties", 0)):
        with pytest.raises(PyllmError, match=f"^invalid json_schema: {where} is 2, above the {required} properties "
                                             f"that object requires, on an object that admits additionalProperties"):
            llm.make_constraint(json_schema=schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads('{"a": 1, "a": 2}'), {"minProperties": 2})
    met = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
           "required": ["a", "b"], "minProperties": 2}
    assert accepts(llm, met, '{"a": 1, "b": 2}') and not accepts(llm, met, '{"a": 1, "a": 2}')
    closed = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "additionalProperties": False, "minProperties": 1}
    assert accepts(llm, closed, '{"b": 2}') and not accepts(llm, closed, "{}")
    # a property that is merely named "minProperties" is not the keyword
    named = {"type": "object", "properties": {"minProperties": {"type": "integer"}}}
    assert accepts(llm, named, '{"minProperties": 3}')


def test_numbers_have_at_most_16_digits_in_a_row_unless_the_schema_needs_more():
    """Numbers under a schema had no digit cap, and a small model could write digits until max_tokens. Reference:
    llama.cpp's json-schema-to-grammar, whose integral part is [0] | [1-9] [0-9]{0,15}, fraction [0-9]{1,16} and
    exponent an integral part: 16 digits in a row at most, in every value a schema admits (json_object's too);
    digits inside strings are text. Bounds, const and enum values that need more digits stay expressible."""
    llm = llm_of("smollm2")
    d16, d17 = "1234567890123456", "12345678901234567"
    for schema in ({"type": "integer"}, {"type": "number"}, {}, {"type": ["integer", "null"]}):
        assert accepts(llm, schema, d16) and accepts(llm, schema, "-" + d16)
        assert not accepts(llm, schema, d17) and not accepts(llm, schema, "-" + d17)
    for number in ("1." + d16, "1e" + d16, "-0.5E-" + d16, d16 + "." + d16 + "e+" + d16):
        assert accepts(llm, {"type": "number"}, number) and not accepts(llm, {"type": "number"}, number + "1")
    anything = {"type": "object"}
    assert accepts(llm, anything, '{"a": [' + d16 + ', {"b": ' + d16 + '}]}')
    assert not accepts(llm, anything, '{"a": [1, {"b": ' + d17 + '}]}')
    assert accepts(llm, anything, '{"' + d17 * 2 + '": "\\"' + d17 * 3 + '"}')  # strings are text
    for schema, value in (({"type": "integer", "minimum": 10 ** 17}, 10 ** 17 + 5),
                          # the nearest double below the bound: the engine cannot exclude -10^17 but keep -10^17 - 1
                          ({"type": "integer", "exclusiveMaximum": -(10 ** 17)}, -(10 ** 17) - 16),
                          ({"type": "number", "exclusiveMinimum": 0, "maximum": 1e-20}, "0.000000000000000000005"),
                          ({"const": 10 ** 20}, 10 ** 20),
                          ({"enum": [1, 0.123456789012345678]}, 0.123456789012345678)):
        text = value if isinstance(value, str) else json.dumps(value)
        assert accepts(llm, schema, text), schema
        jsonschema.validate(json.loads(text), schema)


def test_integers_the_engine_would_round_are_refused_or_bounded_exactly():
    """The engine reads numbers as 64-bit floats and integer bounds as 64-bit integers: {"const": 2^53 + 1} wrote
    9007199254740992, a minimum of 2^53 + 1 admitted 2^53, a maximum of 2^64 was cut to 2^63 - 1 unsaid, and a
    minimum of 2^63 failed naming 9223372036854775807. Reference: exact integer arithmetic (Python ints) and
    jsonschema; tolerance: none. A const or enum integer it would rewrite is refused naming its JSON pointer; a
    bound moves inwards to the nearest value it keeps (the range only narrows); a bound no such value meets is
    refused by name."""
    llm = llm_of("smollm2")
    for schema, where, value in (({"const": 2 ** 53 + 1}, "/const", 2 ** 53 + 1),
                                 ({"type": "object", "properties": {"a/b": {"enum": [1, [2 ** 63]]}}},
                                  "/properties/a~1b/enum/1/0", 2 ** 63),
                                 ({"type": "integer", "minimum": 2 ** 63}, "/minimum", 2 ** 63),
                                 ({"anyOf": [{"type": "integer", "exclusiveMaximum": -(2 ** 63) + 1024}]},
                                  "/anyOf/0/exclusiveMaximum", -(2 ** 63) + 1024)):
        with pytest.raises(PyllmError, match=f"^invalid json_schema: {re.escape(where)} is {value}, "):
            llm.make_constraint(json_schema=schema)
    edge = 2 ** 63 - 1024  # the largest double below 2^63
    for schema, inside, outside in (({"type": "integer", "minimum": 2 ** 53 + 1}, [2 ** 53 + 2], [2 ** 53]),
                                    ({"type": "integer", "maximum": 2 ** 64}, [edge, 5], [edge + 1]),
                                    ({"type": "integer", "minimum": -(2 ** 63)}, [-edge, 0], []),
                                    ({"type": "integer", "minimum": edge}, [edge], [edge - 1]),
                                    ({"type": "integer", "exclusiveMinimum": edge - 1}, [edge], [edge - 1]),
                                    # stepped past in floats, these admitted the bound itself
                                    ({"type": "integer", "exclusiveMinimum": 2 ** 53}, [2 ** 53 + 2], [2 ** 53]),
                                    ({"type": "integer", "exclusiveMinimum": 9.2e18, "maximum": edge},
                                     [9200000000000001024], [9200000000000000000]),
                                    ({"type": "integer", "exclusiveMaximum": -(10 ** 17)}, [-(10 ** 17) - 16],
                                     [-(10 ** 17)])):
        for v in inside:
            assert accepts(llm, schema, str(v)), (schema, v)
            jsonschema.validate(v, schema)
        for v in outside:
            assert not accepts(llm, schema, str(v)), (schema, v)
    assert accepts(llm, {"const": 10 ** 20}, str(10 ** 20))  # a double the engine writes exactly stays
    given = {"type": "integer", "maximum": 2 ** 64}
    llm.make_constraint(json_schema=given)
    assert given == {"type": "integer", "maximum": 2 ** 64}  # the caller's schema is not edited


def test_number_bounds_the_engine_cannot_write_are_refused_naming_where():
    """The engine failed on a number (not integer) bound of magnitude 2^63 or more, and on a one-sided range from
    10^18 up (or -10^18 down), naming only the range: "Failed to generate regex for float range: min=None,
    max=Some(1e19)". Reference: JSON pointers (RFC 6901) into the schema as given; jsonschema for the values the
    bounds just inside those limits admit. Such a bound is one line naming where it is and its value; bounds
    inside the limits still work, exactly."""
    llm = llm_of("smollm2")
    beyond = "beyond the numbers the engine can bound"
    for schema, where, value, why in (
            ({"type": "number", "maximum": 1e19}, "/maximum", "1e+19", beyond),
            ({"type": "object", "properties": {"x/y": {"type": "number", "minimum": 0, "exclusiveMaximum": 1e300}}},
             "/properties/x~1y/exclusiveMaximum", "1e+300", beyond),
            ({"anyOf": [{"type": "string"}, {"type": ["number", "null"], "minimum": -1e19}]},
             "/anyOf/1/minimum", "-1e+19", beyond),
            ({"type": "number", "minimum": 1e18}, "/minimum", "1e+18", "but the range has no maximum"),
            ({"type": "number", "exclusiveMaximum": -5e18}, "/exclusiveMaximum", "-5e+18",
             "but the range has no minimum"),
            ({"type": "number", "maximum": 9.223372036854775e18}, "/maximum",
             "9.223372036854775e+18 (read by the engine as 9.223372036854776e+18)", beyond)):
        with pytest.raises(PyllmError) as e:
            llm.make_constraint(json_schema=schema)
        msg = str(e.value)
        assert msg.startswith(f"invalid json_schema: {where} is {value}, {why}") and "\n" not in msg, msg
    for schema, inside, outside in (({"type": "number", "maximum": 9.2e18}, ["9199999999999999999.5", "-3"],
                                     ["9200000000000000000.5"]),
                                    ({"type": "number", "minimum": 9.9e17}, ["990000000000000000", "1234567890123456789"],
                                     ["-1"]),
                                    ({"type": "number", "minimum": 1e18, "maximum": 2e18},
                                     ["1500000000000000000.25"], ["999999999999999999"])):
        for v in inside:
            assert accepts(llm, schema, v), (schema, v)
            jsonschema.validate(json.loads(v), schema)
        for v in outside:
            assert not accepts(llm, schema, v), (schema, v)


EDGE = 2 ** 63 - 1024  # the largest double below 2^63


@pytest.mark.parametrize("schema,expected", [
    # a number schema follows the number rules whatever its bound's spelling: an integer is not moved inwards
    ({"type": "number", "maximum": 10 ** 19}, "/maximum is 10000000000000000000, beyond the numbers"),
    ({"type": "number", "maximum": 1e19}, "/maximum is 1e+19, beyond the numbers"),
    ({"type": ["integer", "number"], "minimum": 10 ** 18}, "/minimum is 1000000000000000000, but the range has no max"),
    ({"type": ["integer", "number"], "minimum": -1e19}, "/minimum is -1e+19, beyond the numbers"),
    # an integer schema follows the integer rules whatever its bound's spelling: 1e19 is moved inwards as 10^19 is
    ({"type": "integer", "maximum": 10 ** 19}, ([EDGE, 5], [EDGE + 1])),
    ({"type": "integer", "maximum": 1e19}, ([EDGE, 5], [EDGE + 1])),
    ({"type": ["integer", "null"], "minimum": -1e19}, ([-EDGE], [-EDGE - 1])),
    ({"type": "integer", "minimum": 1e19}, "/minimum is 1e+19, beyond the integers"),
    # too many decimal places for the engine's range pattern: named, not its regex parser's nesting limit
    ({"minimum": 1e-300}, "/minimum is 1e-300, 300 decimal places"),
    ({"properties": {"a": {"type": "number", "minimum": 1e-20}, "b~": {"exclusiveMinimum": 1.5e-120}}},
     "/properties/b~0/exclusiveMinimum is 1.5e-120, 121 decimal places"),
    ({"type": "string", "pattern": "(" * 300 + "a" + ")" * 300}, "regex parse error: error: exceed the maximum"),
])
def test_bounds_follow_the_schema_type_not_their_json_spelling(schema, expected):
    """The engine bounds an integer schema as 64-bit integers and a number schema (type "number", a list with it,
    or none) as doubles, whatever a bound's JSON spelling: 10^19 in a number schema was moved inwards to 2^63 - 1024
    as an integer bound, refusing valid numbers, while 1e19 was refused; 1e19 in an integer schema was cut by the
    engine to 2^63 - 1 unsaid, and -1e19 failed naming -2^63. A bound of 1e-300 failed with the engine's regex
    nesting limit, naming neither it nor where. Reference: jsonschema, exact integers; JSON pointers (RFC 6901)."""
    check_bounds(schema, expected)


def check_bounds(schema, expected):
    """``expected``: the start of the one-line refusal after "invalid json_schema: ", or (values the constraint
    takes, each valid under jsonschema; values it refuses), a value an int or its JSON text."""
    llm = llm_of("smollm2")
    if isinstance(expected, str):
        with pytest.raises(PyllmError) as e:
            llm.make_constraint(json_schema=schema)
        msg = str(e.value)
        assert msg.startswith("invalid json_schema: " + expected) and "\n" not in msg, msg
        return
    given = copy.deepcopy(schema)
    inside, outside = expected
    for v in inside:
        text = v if isinstance(v, str) else str(v)
        assert accepts(llm, schema, text), v
        jsonschema.validate(json.loads(text), schema)
    for v in outside:
        assert not accepts(llm, schema, v if isinstance(v, str) else str(v)), v
    assert schema == given  # the caller's schema is not edited


B53 = 2 ** 53


@pytest.mark.parametrize("schema,expected", [
    # the type from allOf, a $ref (to $defs or definitions), a type list, or the branches of anyOf / oneOf
    ({"allOf": [{"type": "integer"}], "minimum": B53 + 1}, ([B53 + 2], [B53])),
    ({"type": "integer", "allOf": [{"minimum": B53 + 1}]}, ([B53 + 2], [B53])),
    ({"$ref": "#/$defs/I", "minimum": B53 + 1, "$defs": {"I": {"type": "integer"}}}, ([B53 + 2], [B53])),
    ({"$ref": "#/definitions/I", "exclusiveMinimum": B53, "definitions": {"I": {"type": "integer"}}},
     ([B53 + 2], [B53])),
    ({"type": "integer", "$ref": "#/$defs/Big", "$defs": {"Big": {"minimum": B53 + 1}}}, ([B53 + 2], [B53])),
    ({"minimum": B53 + 1, "anyOf": [{"type": "integer"}, {"type": "null"}]}, ([B53 + 2, "null"], [B53])),
    ({"minimum": B53 + 1, "oneOf": [{"type": "integer"}, {"type": "string"}]}, ([B53 + 2, '"a"'], [B53])),
    ({"type": "integer", "anyOf": [{"minimum": B53 + 1}, {"maximum": -5}]}, ([B53 + 2, -5], [B53])),
    ({"type": "number", "allOf": [{"type": "integer"}], "minimum": B53 + 1}, ([B53 + 2], [B53])),
    ({"type": ["integer", "number"], "exclusiveMinimum": B53}, ([B53 + 2], [B53])),
    # ... wherever the schema sits
    ({"type": "array", "items": {"allOf": [{"type": "integer"}], "minimum": B53 + 1}},
     ([f"[{B53 + 2}]"], [f"[{B53}]"])),
    ({"type": "object", "additionalProperties": {"$ref": "#/$defs/I", "exclusiveMinimum": B53},
      "$defs": {"I": {"type": "integer"}}}, ([f'{{"a": {B53 + 2}}}'], [f'{{"a": {B53}}}'])),
    ({"type": "array", "prefixItems": [{"anyOf": [{"type": "integer"}]}], "items": False, "minItems": 1,
      "allOf": [{"prefixItems": [{"minimum": B53 + 1}]}]}, ([f"[{B53 + 2}]"], [f"[{B53}]"])),
    # the integer rules' other cases: the far end of an open range, the edge, and the refusal past it
    ({"allOf": [{"type": "integer"}], "minimum": 10 ** 18}, ([10 ** 18, EDGE], ["999999999999999999"])),
    ({"$ref": "#/$defs/I", "maximum": 2 ** 64, "$defs": {"I": {"type": "integer"}}}, ([EDGE], [EDGE + 1])),
    ({"properties": {"a": {"allOf": [{"type": "integer"}], "minimum": 2 ** 63}}},
     "/properties/a/minimum is 9223372036854775808, beyond the integers"),
    # an exclusive bound made inclusive is met with the inclusive one the schema has, whichever comes first
    ({"type": "integer", "exclusiveMinimum": B53 + 10, "minimum": B53 + 1}, ([B53 + 12], [B53 + 2, B53 + 10])),
    # the decimal places refusal names a number bound, not an integer one with more places
    ({"properties": {"a": {"allOf": [{"type": "integer"}], "minimum": 1e-300},
                     "b": {"type": "number", "minimum": 1e-200}}}, "/properties/b/minimum is 1e-200, 200 decimal"),
])
def test_bounds_follow_the_effective_type_wherever_the_schema_sits(schema, expected):
    """pyllm's number rules read only the "type" beside a bound, but the engine bounds a schema by its type
    merged from allOf, a local $ref, the anyOf / oneOf branches and a type list: each of these schemas admitted
    2^53 (or failed naming the range, or kept 2^64 past the edge) as if the integer rules did not exist, and
    {"exclusiveMinimum": 2^53 + 10, "minimum": 2^53 + 1} admitted 2^53 + 2. Reference: jsonschema and exact
    integers; JSON pointers (RFC 6901)."""
    check_bounds(schema, expected)


F62 = 2 ** 62


@pytest.mark.parametrize("schema,expected", [
    ({"type": "number", "minimum": B53 + 1}, ([B53 + 2], [B53, f"{B53}.5"])),
    ({"minimum": 10 ** 16 + 1}, ([10 ** 16 + 2], [10 ** 16, f"{10 ** 16}.5"])),
    ({"type": "number", "maximum": F62 - 1}, ([4611686018427387400, "-1.5"], ["4611686018427387999", F62])),
    ({"type": "number", "maximum": float(F62)}, ([4611686018427387400], ["4611686018427388000"])),
    ({"type": "number", "exclusiveMinimum": B53 + 1}, ([B53 + 2], [B53 + 1])),
    ({"type": "number", "exclusiveMaximum": -(B53 + 1)}, ([-(B53 + 2)], [-(B53 + 1)])),
    ({"type": ["integer", "number"], "minimum": B53 + 1}, ([B53 + 2], [B53, f"{B53}.5"])),
    # a definition bounded both ways: the bound keeps the number reading and the integer one
    ({"type": "object", "properties": {"i": {"type": "integer", "$ref": "#/$defs/B"},
                                       "n": {"type": "number", "$ref": "#/$defs/B"}},
      "$defs": {"B": {"maximum": F62 - 1}}},
     (['{"i": 4611686018427387392, "n": 4611686018427387400}'], ['{"n": 4611686018427387999}', f'{{"i": {F62}}}'])),
    # from 10^18 too, where the range is closed by a schema merged with this one; open, it is named as given
    ({"type": "number", "minimum": 2 ** 60 + 12343, "allOf": [{"maximum": F62}]},
     ([1152921504606859500], [1152921504606859318])),
    ({"type": "number", "minimum": 10 ** 18 + 1}, "/minimum is 1000000000000000001 (read by the engine as "
                                                   "1.0000000000000001e+18), but the range has no maximum"),
    # inside 2^53 the engine reads a bound exactly, and a number bound it reads inwards stays
    ({"type": "number", "minimum": B53 - 1}, ([B53 - 1], [B53 - 2])),
    ({"type": "number", "minimum": F62 + 1, "maximum": F62 + 10 ** 6}, ([4611686018427388000], [F62 + 1 - 2])),
])
def test_number_bounds_past_2_53_are_kept_exactly(schema, expected):
    """The engine writes a number range from the shortest digits of the bound's nearest double, so from 2^53 in
    magnitude a bound it could write was read as a value outside it: a minimum of 2^53 + 1 admitted 2^53 and
    2^53 + 0.5, a maximum of 2^62 - 1 admitted 4611686018427388000, an exclusive bound admitted itself. Such a
    bound moves inwards to the nearest value the engine reads as keeping it, as an integer bound does (the range
    only narrows, by less than one step of the double). Reference: jsonschema, exact integer comparison."""
    check_bounds(schema, expected)


def test_a_model_pushed_to_write_digits_stops_at_the_cap():
    """Gemma 3 with its "7" token pushed up by logit_bias wrote sevens until max_tokens (finish "length", a number
    no JSON reader keeps exactly). Reference: llama.cpp's 16-digit integral part; the reply ends there, complete."""
    llm = llm_of("gemma3")
    seven = llm.tokenizer.token_id("7")
    r = llm.create_completion("A very large number: ", json_schema={"type": "integer"}, max_tokens=40,
                              temperature=0, logit_bias={str(seven): 100})["choices"][0]
    assert r["text"].strip() == "7" * 16 and r["finish_reason"] == "stop"


def test_an_object_never_repeats_a_key():
    """The engine kept named properties distinct but let additionalProperties / patternProperties (and any object
    of {"type": "object"}) write a key twice: {"a": 1, "a": 2} passed, and a JSON reader keeps only the last value
    (Python's json, jsonschema's instance). Reference: RFC 8259's "names within an object SHOULD be unique" as
    the readers apply it; exact checks of the mask, however the tokens split the key and its quote."""
    llm = llm_of("smollm2")
    free = {"type": "object"}
    ints = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "integer"}}
    pattern = {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False}
    for schema, repeated, distinct in ((free, '{"a": 1, "a": 2}', '{"a": 1, "A": 2}'),
                                       (free, '{"b": {"c": 1}, "b": 2}', '{"b": {"c": 1}, "c": 2}'),
                                       (ints, '{"a": 1, "b": 2, "b": 3}', '{"a": 1, "b": 2, "bb": 3}'),
                                       (pattern, '{"x": 1, "xy": 2, "x": 3}', '{"x": 1, "xy": 2, "xz": 3}'),
                                       ({"type": "array", "items": free}, '[{"k": 1, "k": 1}]', '[{"k": 1, "j": 1}]')):
        assert not accepts(llm, schema, repeated) and accepts(llm, schema, distinct), repeated
    for text in ('{"a": {"a": 1}, "b": 2}', '{"ab": 1, "a": 2, "b": "a"}', '{"a": "b", "b": 1}',
                 '{"a\\"b": 1, "a": 2}', '{"k": [{"k": 1}, {"k": 2}]}'):
        assert accepts(llm, free, text), text
    assert accepts(llm, {"type": "array", "items": free}, '[{"a": 1}, {"a": 2}]')
    # one character per token: the repeated key's closing quote is refused on its own, and the object goes on
    c = llm.make_constraint(json_schema=free)
    for ch in '{"ab":1,"ab':
        t = llm.tokenizer.token_id(ch)
        assert c.allowed()[t], ch
        c.advance(t)
    quote_tokens = [i for i, b in enumerate(c.vocab.tokens) if b.startswith(b'"')]
    assert not c.allowed()[quote_tokens].any() and c.allowed()[llm.tokenizer.token_id("c")]
    assert json.loads('{"a": 1, "a": 2}') == {"a": 2}  # what a repeated key costs


def test_a_key_spelled_with_escapes_is_the_same_key():
    """Keys were compared as written, so {"\\n": 1, "\\u000a": 2} passed the distinct-key rule, and a JSON reader
    keeps one key "\\n" (Python's json, jsonschema's instance). The engine admits \\u escapes for control
    characters only, in either case of hex digit, so those are the spellings a model can repeat. Reference:
    json.loads of each text; exact: a text is refused iff it parses to fewer keys than it writes, for the mask
    (accepts, as the tokenizer splits the text) and for a draft (valid_prefix)."""
    llm = llm_of("smollm2")
    free = {"type": "object"}
    for text in ('{"\\n": 1, "\\u000a": 2}', '{"\\u000A": 1, "\\n": 2}', '{"a\\t": 1, "a\\u0009": 2}',
                 '{"x": {"\\u001fy": 1, "\\u001Fy": 2}}', '{"\\b": 1, "\\u0008": 2}'):
        assert len(json.loads(text)) < text.count(":"), text  # the reference: a key is lost
        assert not accepts(llm, free, text), text
        c = llm.make_constraint(json_schema=free)
        ids = llm.tokenize(text, add_bos=False, special=False)
        assert c.valid_prefix(ids) < len(ids), text
    for text in ('{"\\u000a": 1, "\\u000b": 2}', '{"\\n": 1, "n": 2}', '{"a\\\\": 1, "a": 2}',
                 '{"\\"": 1, "\\\\": 2}'):
        assert len(json.loads(text)) == 2, text
        assert accepts(llm, free, text), text


def test_a_token_that_finishes_an_escape_and_closes_a_repeated_key_is_masked():
    """A token such as 'a"' after '"\\u000' would finish the escape as "\\n" and close the key: the mask must drop
    it where the object already has "\\n", as it drops a plain repeat's closing quote. The fixture vocabularies
    have no hex digit + quote token, so one is added to a copy of the vocabulary's index (an id of the plain "a"
    stands for it). Reference: json.loads('"\\u000a"') == "\\n"; exact: the closings listed are every spelling
    of the finished escape (either case of hex digit) and nothing else."""
    from pyllm.runtime.constraint import _closings

    assert json.loads('"\\u000a"') == "\n" == json.loads('"\\n"')
    assert sorted(_closings(b"\\u000", b"\n")) == [b'A"', b'a"']
    assert sorted(_closings(b"\\u00", b"\nx")) == [b'0Ax"', b'0ax"']
    assert sorted(_closings(b"\\", b"\n")) == [b'n"', b'u000A"', b'u000a"']
    assert _closings(b"", b"ab") == [b'ab"'] and _closings(b"", b"a\n") == [] and _closings(b"\\u001", b"\n") == []
    llm = llm_of("smollm2")
    c = llm.make_constraint(json_schema={"type": "object"})
    for ch in '{"\\n":1,"\\u000':
        t = llm.tokenizer.token_id(ch)
        assert c.allowed()[t], ch
        c.advance(t)
    stand_in, other = llm.tokenizer.token_id("a"), llm.tokenizer.token_id("b")
    c.vocab = copy.copy(c.vocab)
    c.vocab.quote_prefixes = {**c.vocab.quote_prefixes, b'a"': [stand_in], b'b"': [other]}
    allowed = np.ones(c.vocab.n_vocab, dtype=bool)
    rules = c._json_rules(allowed)
    assert not rules[stand_in] and rules[other]  # "\\u000b" is another key


def test_a_forced_call_is_closed_after_its_arguments():
    """The forced call object is {"name", "arguments"} and nothing more: SmolLM2 went on writing "type",
    "function" or "parameters" keys after the arguments until max_tokens cut the call off (finish_reason
    "length", no tool_calls). Checked on the constraint itself (exact, whatever the model would pick)."""
    from pyllm.chat_messages import forced_call

    llm = llm_of("smollm2")
    params = {"type": "object", "properties": {"v": {"const": 42}}, "required": ["v"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}},
             {"type": "function", "function": {"name": "g"}}]
    for name in ("", "f"):  # tool_choice "required", and the named function
        def call(text):
            return accepts(llm, None, text, forced_call(llm, tools, name, {})[1]["constraint"])
        assert call('{"name": "f", "arguments": {"v": 42}}')
        assert not call('{"name": "f", "arguments": {"v": 42}, "type": "function"}')
    # the tool's own schema lists "v" and says nothing of additionalProperties: false, as llama.cpp reads it
    assert not call('{"name": "f", "arguments": {"v": 42, "w": 1}}')
    open_params = {**params, "additionalProperties": True}
    tools[0]["function"]["parameters"] = open_params
    assert accepts(llm, None, '{"name": "f", "arguments": {"v": 42, "w": 1}}',
                   forced_call(llm, tools, "f", {})[1]["constraint"])


def test_accepts_text_agrees_with_json_on_every_prefix_in_any_order():
    """Constraint.accepts_text keeps its own matcher at the last text asked about (so the stop-string checks of a
    growing output cost the new part only: 1203 checks over a 17 KB reply took 0.03 s, 9.3 s when each started
    over). Reference: json.loads + jsonschema on the prefix; asked in order, in reverse and at random."""
    import random

    llm = llm_of("smollm2")
    cases = [({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
               "required": ["a"], "additionalProperties": True}, '{"a": [1, 23, -4], "b": "x y"}'),
             ({"type": "integer"}, "-12345")]
    for schema, doc in cases:

        def valid(text):
            try:
                jsonschema.validate(json.loads(text), schema)
                return True
            except (ValueError, jsonschema.ValidationError):
                return False

        ends = list(range(len(doc) + 1))
        for order in (ends, ends[::-1], random.Random(0).sample(ends, len(ends)) * 2):
            c = llm.make_constraint(json_schema=schema)
            for i in order:
                assert c.accepts_text(doc[:i]) == valid(doc[:i]), (doc[:i], schema)


def test_response_format_takes_boolean_schemas():
    """true and false are JSON schemas (any value; no value). true was a 400 at response_format though the library's
    json_schema=True took it; false would have read as "no schema" (anything). Now true constrains to any JSON value
    (json.loads, the reference, parses what it accepts) and false is a 400 naming response_format."""
    from pyllm.structured_output import structured_output_kwargs
    from pyllm.errors import BadRequest

    llm = llm_of("smollm2")

    def rf(schema):
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}

    for text, ok in (('"x"', True), ("[1, 2]", True), ('{"a": null}', True), ("abc", False), ("{", False)):
        c = structured_output_kwargs(llm, rf(True))["constraint"]
        assert accepts(llm, None, text, c) == ok, text
        if ok:
            json.loads(text)
    for bad in (False, "object", [1]):
        with pytest.raises(BadRequest) as e:
            structured_output_kwargs(llm, rf(bad))
        assert e.value.param == "response_format"


def test_forced_call_schema_with_an_id_resolves_its_references():
    """A tool schema with a root "$id" (what schema generators often write) was a 400: moved under the call
    object it became an embedded resource the engine would not resolve "#/$defs/..." against. References plain
    or spelled through the $id resolve; checked on the constraint against jsonschema's verdicts (the reference)."""
    from pyllm.chat_messages import forced_call

    llm = llm_of("smollm2")
    base = "https://example.com/schemas/weather.json"
    city = {"type": "object", "properties": {"name": {"enum": ["Paris", "Oslo"]}}, "required": ["name"],
            "additionalProperties": False}
    for ref in ("#/$defs/City", base + "#/$defs/City"):
        params = {"$id": base, "type": "object", "properties": {"city": {"$ref": ref}}, "required": ["city"],
                  "additionalProperties": False, "$defs": {"City": city}}
        tools = [{"type": "function", "function": {"name": "w", "parameters": params}}]
        for args, ok in (({"city": {"name": "Oslo"}}, True), ({"city": {"name": "Rome"}}, False),
                         ({"city": "Oslo"}, False)):
            assert jsonschema.Draft202012Validator(params).is_valid(args) == ok
            text = json.dumps({"name": "w", "arguments": args})
            assert accepts(llm, None, text, forced_call(llm, tools, "w", {})[1]["constraint"]) == ok, (ref, text)


def served_calls(llm, msgs, **kw) -> list[list[dict]]:
    """The tool_calls of one forced-call request, answered whole (finish_reason "tool_calls") and streamed."""
    r = llm.create_chat_completion(msgs, **kw)
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    chunks = list(llm.create_chat_completion(msgs, stream=True, **kw))
    return [r["choices"][0]["message"]["tool_calls"],
            [tc for ch in chunks for tc in ch["choices"][0]["delta"].get("tool_calls", [])]]


def test_forced_call_arguments_are_json_text_whatever_the_schema_admits():
    """OpenAI's tool_calls[].function.arguments is JSON text (the openai client's users json.loads it). A tool whose
    parameters admit a string got the string's characters as its arguments ('quo"te', not JSON); now they are
    the JSON of the value the constraint produced, streamed or not, and it validates against the schema
    (jsonschema, the reference)."""
    llm = llm_of("smollm2")
    params = {"enum": ['quo"te', "日本語", "{}"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    kw = dict(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}}, max_tokens=48,
              temperature=0)
    msgs = [{"role": "user", "content": "Call f."}]
    for call in served_calls(llm, msgs, **kw):
        assert len(call) == 1 and call[0]["function"]["name"] == "f"
        jsonschema.validate(json.loads(call[0]["function"]["arguments"]), params)


def test_forced_call_to_a_tool_without_parameters_passes_no_arguments():
    """OpenAI's reference: "omitting parameters defines a function with an empty parameter list". A forced call to
    such a tool was constrained as if its arguments could be any JSON value, and SmolLM2 answered
    "arguments": "[1, 2, 3]", which a client cannot pass to the function. The constraint now admits only {}
    (checked exactly on the constraint), and the served call's arguments json.loads to {}, streamed or not."""
    from pyllm.chat_messages import forced_call

    llm = llm_of("smollm2")
    tools = [{"type": "function", "function": {"name": "g"}},
             {"type": "function", "function": {"name": "f", "parameters": None}}]
    for name in ("", "g", "f"):  # tool_choice "required", and each named function
        def call(args):
            text = '{"name": "%s", "arguments": %s}' % (name or "g", args)
            return accepts(llm, None, text, forced_call(llm, tools, name, {})[1]["constraint"])
        assert call("{}")
        for args in ("[1, 2, 3]", '"x"', "null", '{"x": 1}'):
            assert not call(args), args
    msgs = [{"role": "user", "content": "Call the function."}]
    kw = dict(tools=tools[:1], tool_choice={"type": "function", "function": {"name": "g"}}, max_tokens=48,
              temperature=0)
    for call in served_calls(llm, msgs, **kw):
        assert len(call) == 1 and call[0]["function"]["name"] == "g"
        assert json.loads(call[0]["function"]["arguments"]) == {}


def test_a_schema_defined_only_as_itself_is_refused_naming_the_reference():
    """{"$ref": "#"} (or $defs that name each other, or allOf of itself) describes no value: jsonschema, the
    reference, cannot check any instance against it (RecursionError). The engine failed on it with its internals'
    "NoExtensionBias Error: None", and as a forced tool's parameters only once generation reached them (a 200
    stream, then an error). Now it is refused when the constraint is built, naming the reference; recursion through
    a value (an array of itself, a tree) still works."""
    from pyllm.chat_messages import forced_call
    from pyllm.errors import BadRequest
    from pyllm.structured_output import structured_output_kwargs

    llm = llm_of("smollm2")
    loops = ({"$ref": "#"}, {"allOf": [{"$ref": "#"}]},
             {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})
    for schema in loops:
        with pytest.raises(RecursionError):
            jsonschema.Draft202012Validator(schema).is_valid(1)
        with pytest.raises(PyllmError, match=r'"\$ref": .* leads back to itself'):
            llm.make_constraint(json_schema=schema)
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        with pytest.raises(BadRequest, match="leads back to itself") as e:
            structured_output_kwargs(llm, rf)
        assert e.value.param == "response_format"
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        with pytest.raises(BadRequest, match="leads back to itself") as e:
            forced_call(llm, tools, "f", {})
        assert e.value.param == "tools"
    tree = {"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                            "required": ["c"], "additionalProperties": False}}, "$ref": "#/$defs/n"}
    assert accepts(llm, tree, '{"c": [{"c": []}]}') and not accepts(llm, tree, '{"c": [1]}')
    assert accepts(llm, {"type": "array", "items": {"$ref": "#"}}, "[[], [[]]]")


def test_forced_call_with_false_parameters_is_a_bad_request():
    """parameters: false is a JSON schema no arguments match; it was read as "no schema" and the call went out
    unconstrained (jsonschema rejects whatever arguments came back). A forced call to it is a 400 naming tools;
    parameters: true still admits any arguments."""
    from pyllm.chat_messages import forced_call
    from pyllm.errors import BadRequest

    llm = llm_of("smollm2")
    tools = [{"type": "function", "function": {"name": "f", "parameters": False}},
             {"type": "function", "function": {"name": "g", "parameters": True}}]
    for name in ("", "f"):
        with pytest.raises(BadRequest, match="parameters of 'f' are false") as e:
            forced_call(llm, tools, name, {})
        assert e.value.param == "tools"
    c = forced_call(llm, tools, "g", {})[1]["constraint"]
    assert accepts(llm, None, '{"name": "g", "arguments": [1, "x"]}', c)


def test_stop_strings_end_structured_output_only_where_it_is_complete():
    """A stop string inside a constrained reply (stop="\n" or '"' in JSON) cut it at "{" and called it finished:
    invalid output presented as complete. Under a constraint a stop string ends the output only after a complete
    match; the references are json.loads + jsonschema and the grammar's own language, spelled out here."""
    llm = llm_of("smollm2")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    msgs = [{"role": "user", "content": "Give JSON."}]
    for stream in (False, True):
        r = llm.create_chat_completion(msgs, response_format=rf, max_tokens=48, temperature=0, stream=stream,
                                       stop=["\n", '"', ":", "{"])
        if stream:
            chunks = list(r)
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text, finish = r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"]
        jsonschema.validate(json.loads(text), schema)
        assert finish == "stop"
    # LLM.generate / chat share the rule
    for stream in (False, True):
        out = llm.chat(msgs, max_tokens=48, temperature=0, stop=["\n", '"', ":", "{"], json_schema=schema,
                       stream=stream)
        jsonschema.validate(json.loads(out if isinstance(out, str) else "".join(out)), schema)
    assert llm.generate("Letters: ", grammar='root ::= [a-z]+ (" " [a-z]+)*', stop=[" "], max_tokens=32,
                        temperature=0).isalpha()
    # "ab" and "ab cd" are not in the language: the spaces after them are kept; the first space after a complete
    # match ends the output there.
    g = 'root ::= "ab cd" (" " [a-z]+)+'
    r = llm.create_completion("Letters: ", grammar=g, stop=[" "], max_tokens=32, temperature=0)
    text = r["choices"][0]["text"]
    words = text.split(" ")
    assert len(words) == 3 and words[:2] == ["ab", "cd"] and words[2].isalpha() and words[2].islower(), text
    # where every prefix of letters is complete, the first space ends it
    r = llm.create_completion("Three words: ", grammar='root ::= [a-z]+ (" " [a-z]+)*', stop=[" "],
                              max_tokens=32, temperature=0)
    text = r["choices"][0]["text"]
    assert text.isalpha() and text.islower() and r["choices"][0]["finish_reason"] in ("stop", "length"), text


def test_make_constraint_none_without_request():
    assert make_constraint(lambda: pytest.fail("vocabulary built for nothing")) is None
    assert isinstance(make_constraint(lambda: llm_of("smollm2").grammar_vocab, grammar='root ::= "a"'), Constraint)


def test_grammars_and_schemas_deep_in_rules_are_errors_not_crashes(smollm2_path):
    # rules naming rules 3,000 deep (a GBNF or Lark chain, a schema whose definitions each name the next) made the
    # engine's recursive compiler overflow the caller's stack: the process died of SIGSEGV, the server with it;
    # GBNF chains also took time growing with the square of their depth. In a subprocess: the crash is the failure.
    code = textwrap.dedent(f"""
        import json
        from pyllm.errors import PyllmError
        from pyllm.formats.gguf import open_gguf
        from pyllm.runtime.constraint import Constraint, GrammarVocab
        from pyllm.tokenizer import Tokenizer

        with open_gguf({smollm2_path!r}) as gf:
            vocab = GrammarVocab(Tokenizer.from_gguf(gf.metadata))
        n = 3000
        defs = {{f"a{{i}}": {{"type": "array", "items": {{"$ref": f"#/$defs/a{{i + 1}}"}}}} for i in range(5000)}}
        defs["a5000"] = {{"type": "integer"}}
        cases = [("gbnf", "root ::= r0\\n" + "".join(f"r{{i}} ::= r{{i + 1}} | \\"x\\"\\n" for i in range(n))
                  + f"r{{n}} ::= \\"y\\"\\n"),
                 ("lark", "start: r0\\n" + "".join(f"r{{i}}: r{{i + 1}} | \\"x\\"\\n" for i in range(n))
                  + f"r{{n}}: \\"y\\"\\n"),
                 ("schema", {{"$defs": defs, "$ref": "#/$defs/a0"}})]
        for kind, spec in cases:
            try:
                c = Constraint.from_json_schema(spec, vocab) if kind == "schema" else Constraint.from_gbnf(spec, vocab)
                c.allowed()
                print(kind, "ok")
            except PyllmError as e:
                print(kind, "error:", e)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["gbnf error: grammar has 3002 rules; at most 1000 are supported",
                                     "lark error: grammar has 3002 rules; at most 1000 are supported",
                                     "schema ok"], r.stdout


# ---- CLI and README -----------------------------------------------------------------------------------------
def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "pyllm", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


def test_cli_run_json_schema_and_grammar(tmp_path, smollm2_path):
    (tmp_path / "s.json").write_text(json.dumps(PERSON))
    res = run_cli("run", smollm2_path, "Invent a user record as JSON.", "--chat", "--json-schema",
                  str(tmp_path / "s.json"), "--temp", "0", "-n", "96", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["finish_reason"] == "eog"
    jsonschema.validate(json.loads(out["text"]), PERSON)
    for name, text, why in [
        ("bad.gbnf", "root ::= missing\n", "Rule 'missing' not found"),
        # was "grammar constraint failed: NoExtensionBias Error: None" at the first step, naming no file
        ("loop.gbnf", "root ::= a\na ::= root\n", "rule 'root' can never finish: every alternative refers back "
                                                   "to itself through 'a', so the grammar matches no text"),
    ]:
        (tmp_path / name).write_text(text)
        res = run_cli("run", smollm2_path, "x", "--grammar", str(tmp_path / name), "-n", "2")
        assert res.returncode == 1 and "Traceback" not in res.stderr
        assert res.stderr.strip().splitlines() == [f"pyllm: error: --grammar {shorten(str(tmp_path / name))}: "
                                                   f"invalid grammar: {why}"]


def readme_section(title):
    text = (Path(__file__).parents[1] / "README.md").read_text()
    start = text.index(title)
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_readme_structured_output_examples(tmp_path):
    """Runs the README's library and CLI examples as written (registry model names resolve from the cache)."""
    sec = readme_section("### Structured output")
    py = re.search(r"```python\n(.*?)```", sec, re.S).group(1)
    sh = re.search(r"```bash\n(.*?)```", sec, re.S).group(1)
    res = subprocess.run([sys.executable, "-c", py], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    person_line, primes_line = res.stdout.strip().splitlines()
    person = eval(person_line, {})  # printed dict
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert re.fullmatch(r"\[[0-9]+(, [0-9]+){2}\]", primes_line), primes_line
    script = sh.replace("pyllm run", f"{sys.executable} -m pyllm run")
    res = subprocess.run(["bash", "-ec", script], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert isinstance(json.loads(res.stdout)["city"], str)


def test_cli_schema_or_grammar_errors_name_the_file(tmp_path, smollm2_path, monkeypatch, capsys):
    """A --json-schema or --grammar file whose content is bad was reported without naming the file ("json_schema
    is not valid JSON: ..."); the error now starts with the flag and the file. Reference: the one-line
    "pyllm: error:" convention of tests/test_doors.py, exit 1, no traceback."""
    from conftest import cli_in_process

    cli = cli_in_process(monkeypatch, capsys)
    (tmp_path / "notjson.json").write_text("root: x\n")
    (tmp_path / "badtype.json").write_text('{"type": "foo"}')
    (tmp_path / "bad.gbnf").write_text("root ::= missing\n")
    for flag, name, why in (("--json-schema", "notjson.json", "not valid JSON"),
                            ("--json-schema", "badtype.json", "Invalid type: foo"),
                            ("--grammar", "bad.gbnf", "missing")):
        path = str(tmp_path / name)
        res = cli("run", smollm2_path, "x", flag, path, "-n", "2")
        lines = [ln for ln in res.stderr.strip().splitlines() if "error" in ln]
        assert res.returncode == 1 and "Traceback" not in res.stderr and len(lines) == 1, res.stderr
        assert lines[0].startswith(f"pyllm: error: {flag} {shorten(path)}: ") and why in lines[0], lines[0]


def test_oneof_the_engine_cannot_keep_exclusive_and_engine_options():
    """JSON Schema's oneOf admits a value only if exactly one branch matches. The engine keeps that only where it
    can show the branches exclusive; otherwise its message names an option without saying where it goes. The
    refusal is one line naming the three ways out, and each way works: anyOf, a "const" per branch, and
    x-guidance's coerce_one_of (then 5, which both branches match, is generated as anyOf would)."""
    llm = llm_of("smollm2")
    overlapping = {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]}
    with pytest.raises(PyllmError) as e:
        llm.make_constraint(json_schema=overlapping)
    msg = str(e.value)
    assert msg.startswith("invalid json_schema: a oneOf whose branches could both match") and "\n" not in msg, msg
    assert "anyOf" in msg and '"const"' in msg and '"x-guidance": {"coerce_one_of": true}' in msg, msg
    assert accepts(llm, {"anyOf": overlapping["oneOf"]}, "5")
    assert accepts(llm, {"x-guidance": {"coerce_one_of": True}, **overlapping}, "5")
    tagged = {"oneOf": [{"type": "object", "properties": {"kind": {"const": k}, k: {"type": t}}, "required": ["kind", k]}
                        for k, t in (("a", "string"), ("b", "integer"))]}
    assert accepts(llm, tagged, '{"kind": "b", "b": 7}')
    assert not accepts(llm, tagged, '{"kind": "a", "a": 7}')
    # the engine's other options set separators and whitespace: its output would be other text than JSON with
    # bounded whitespace (key_separator "::" wrote {"a"::1 ;"b"::[1]}), so they are refused, naming the option
    for options, named in (({"key_separator": "::"}, "'key_separator'"), ({"whitespace_pattern": "[ ]*"},
                           "'whitespace_pattern'"), ({"whitespace_flexible": True}, "'whitespace_flexible'"),
                           (5, "must be an object")):
        with pytest.raises(PyllmError) as e:
            llm.make_constraint(json_schema={"type": "integer", "x-guidance": options})
        assert str(e.value).startswith('invalid json_schema: "x-guidance"') and named in str(e.value), str(e.value)
    assert accepts(llm, {"type": "integer", "x-guidance": {"lenient": True}}, "5")
    # a grammar's own refusals pass through as the engine words them
    with pytest.raises(PyllmError, match="^invalid grammar"):
        llm.make_constraint(grammar="root ::= undefined_rule")
