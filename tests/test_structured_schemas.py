"""JSON schemas whose meaning depends on how their parts merge or how their values read: property counts met by
"required" written elsewhere (allOf, $ref, anyOf), number bounds a decimal meets only once a JSON reader makes it
a double (or that the engine reads as another double), and date / time formats a reader checks against the
calendar.

Reference: the ``jsonschema`` package (Draft 2020-12) on the output as Python's json reads it; JSON pointers
(RFC 6901) into the schema as given for refusals. Sampled outputs: smollm2, temperature 1, fixed seeds.
"""

import json
import re
from decimal import Decimal

import pytest

jsonschema = pytest.importorskip("jsonschema")  # in the test extra; CI installs it

from conftest import pyllm_model  # noqa: E402
from pyllm import PyllmError  # noqa: E402

B53 = 2 ** 53


def smollm2():
    return pyllm_model("smollm2", n_ctx=512)


def accepts(llm, schema, text) -> bool:
    """Whether the constraint for ``schema`` takes ``text`` (as the tokenizer splits it) as a complete output."""
    c = llm.make_constraint(json_schema=schema)
    for t in llm.tokenize(text, add_bos=False, special=False):
        if not c.allowed()[t]:
            return False
        c.advance(t)
    return c.is_accepting()


def sampled_outputs_validate(llm, schema, prompt, seeds=(1, 2, 3), max_tokens=48):
    """Every finished sample under ``schema`` validates with jsonschema; returns how many finished."""
    finished = 0
    for seed in seeds:
        out = llm.generate(prompt, json_schema=schema, max_tokens=max_tokens, temperature=1, seed=seed)
        if llm.stats.finish_reason == "eog":
            jsonschema.Draft202012Validator(schema).validate(json.loads(out))
            finished += 1
    return finished


AB = {"a": {"type": "integer", "maximum": 9}, "b": {"type": "integer", "maximum": 9}}


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": AB, "allOf": [{"required": ["a", "b"]}], "minProperties": 2},
    {"type": "object", "allOf": [{"properties": AB, "required": ["a", "b"]}], "minProperties": 2},
    {"type": "object", "properties": AB, "$ref": "#/$defs/R", "$defs": {"R": {"required": ["a", "b"]}},
     "minProperties": 2},
    {"type": "object", "properties": AB, "required": ["a"], "allOf": [{"minProperties": 1}]},
    # each branch is merged with the schema: either way two names are required
    {"type": "object", "properties": AB, "minProperties": 2,
     "anyOf": [{"required": ["a", "b"]}, {"required": ["b", "a"]}]},
    # a branch that is no object leaves the object's count to the others
    {"minProperties": 2, "anyOf": [{"type": "string", "maxLength": 3}, {"type": "object", "properties": AB,
                                                                        "required": ["a", "b"]}]},
], ids=["allOf-required", "allOf-properties", "ref-required", "allOf-minProperties", "anyOf-required",
        "anyOf-other-type"])
def test_min_properties_counts_required_names_from_every_merged_member(schema):
    """minProperties was checked against the "required" beside it only, so these schemas, whose required names
    (in an allOf member, a $ref target, every anyOf branch) meet it, were refused as if keys could repeat.
    Reference: jsonschema on sampled outputs."""
    llm = smollm2()
    llm.make_constraint(json_schema=schema)
    assert sampled_outputs_validate(llm, schema, "A JSON object with a and b: ") >= 1


@pytest.mark.parametrize("schema,message", [
    # keys that additionalProperties admits are not kept distinct: still refused, now naming where
    ({"type": "object", "properties": AB, "additionalProperties": True,
      "allOf": [{"required": ["a"]}, {"minProperties": 2}]},
     "/allOf/1/minProperties is 2, above the 1 properties that object requires, on an object that admits "
     "additionalProperties"),
    ({"type": "object", "$ref": "#/$defs/M", "$defs": {"M": {"minProperties": 1, "additionalProperties": True}}},
     "/$defs/M/minProperties is 1, above the 0 properties that object requires"),
    # no object meets these: named, where the engine said only "Unsatisfiable schema" or "min/maxProperties only
    # supported when all keys listed in "properties" are required"
    ({"type": "object", "allOf": [{"minProperties": 3}], "maxProperties": 1},
     "/allOf/0/minProperties is 3, above /maxProperties (1): no object has both"),
    ({"type": "object", "properties": AB, "allOf": [{"required": ["a", "b"]}], "maxProperties": 1},
     "/maxProperties is 1, but the object requires 2 properties ('a', 'b')"),
    ({"type": "object", "properties": AB, "additionalProperties": False, "minProperties": 3},
     "/minProperties is 3, but additionalProperties false (as written, or absent, which reads as false) leaves the "
     "object only 2 names it may have"),
    # additionalProperties false in a member admits none of the names beside it (as jsonschema reads it)
    ({"type": "object", "properties": AB, "allOf": [{"additionalProperties": False}], "minProperties": 1},
     "/minProperties is 1, but additionalProperties false (as written, or absent, which reads as false) leaves the "
     "object only 0 names"),
    # a count the engine cannot generate (it needs every listed name required): named, with its rule
    ({"type": "object", "properties": {"x": {"type": "object", "properties": AB, "maxProperties": 1,
                                             "additionalProperties": True}}},
     "/properties/x/maxProperties is 1: the engine bounds the number of properties only where every name"),
])
def test_property_counts_that_cannot_be_kept_are_refused_naming_where(schema, message):
    """Reference: JSON pointers (RFC 6901) into the schema as given; one line."""
    llm = smollm2()
    with pytest.raises(PyllmError) as e:
        llm.make_constraint(json_schema=schema)
    msg = str(e.value)
    assert msg.startswith("invalid json_schema: " + message) and "\n" not in msg, msg


def test_an_unsatisfiable_count_in_an_optional_place_is_not_refused():
    """An object no value meets, under a property that may be left out, leaves the schema satisfiable: the
    engine drops the property, and pyllm refused it as a repeated-key risk."""
    llm = smollm2()
    schema = {"type": "object", "properties": {"x": {"type": "object", "minProperties": 3, "maxProperties": 1},
                                               "y": {"type": "boolean"}}, "additionalProperties": False}
    assert accepts(llm, schema, '{"y": true}') and not accepts(llm, schema, '{"x": {}}')


@pytest.mark.parametrize("schema,inside,outside", [
    # past 2^53 every double is an integer: a fraction next to the bound reads as the bound
    ({"type": "number", "exclusiveMaximum": -3e17}, ["-300000000000000192", "-310000000000000000.25"],
     ["-300000000000000000.5", "-300000000000000001"]),
    ({"type": "number", "exclusiveMinimum": B53, "maximum": 2.0 ** 60}, [str(B53 + 2)], [f"{B53}.5"]),
    ({"type": "number", "minimum": 9e17, "exclusiveMaximum": 1e18}, ["999999999999999700"],
     ["999999999999999999.5"]),
    ({"type": "number", "exclusiveMinimum": -1e300, "maximum": 0}, None, None),  # refused: past what it bounds
    # below 2^53 too, where the schema's own digits allow a fraction within one step of the bound
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 2}, ["1.0000000000000003", "2"],
     ["1.0000000000000001"]),
    ({"type": "number", "exclusiveMinimum": 0.5, "exclusiveMaximum": 0.50000000000000011}, None, None),
    ({"type": ["integer", "number"], "exclusiveMaximum": -1, "minimum": -2}, ["-1.0000000000000003", "-2"],
     ["-1.0000000000000001", "-1"]),
    # an exclusive 0 stays: no number this schema allows has the 324 places that would read as 0
    ({"type": "number", "exclusiveMinimum": 0, "maximum": 1}, ["0.0000000000000001"], ["0"]),
])
def test_exclusive_number_bounds_hold_once_the_output_is_read_as_a_double(schema, inside, outside):
    """The engine compares the decimal it writes with the bound exactly, but Python's json reads a number with a
    fraction as a double: under an exclusiveMaximum of -3e17 it wrote -300000000000000000.5, which reads as
    -3e17, the bound. Reference: jsonschema on json.loads of each text. The range narrows by a double step or two
    at most (-300000000000000192 is the second double below -3e17; the first, -300000000000000128, is written
    -3.0000000000000013e17, which the engine would read as a value below it)."""
    llm = smollm2()
    if inside is None:
        with pytest.raises(PyllmError, match=r"^invalid json_schema: "):
            llm.make_constraint(json_schema=schema)
        return
    validator = jsonschema.Draft202012Validator(schema)
    for text in inside:
        assert accepts(llm, schema, text), (schema, text)
        validator.validate(json.loads(text))
    for text in outside:
        assert not accepts(llm, schema, text), (schema, text)
    sampled_outputs_validate(llm, schema, "A number: ", max_tokens=32)


@pytest.mark.parametrize("bound", [B53, 3e17, 2.0 ** 60, 9.2e18, 1e300])
@pytest.mark.parametrize("key", ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"])
@pytest.mark.parametrize("sign", [1, -1])
def test_every_sampled_number_next_to_a_far_bound_validates(bound, key, sign):
    """Bounds from 2^53 to 1e300 on either side, inclusive and exclusive: each sample, read by Python's json,
    validates with jsonschema, or the schema is refused up front naming the keyword's pointer. The far side is
    closed one double step away, so the model writes next to the bound."""
    llm = smollm2()
    value = sign * bound
    lower = key.endswith("inimum")
    far = value * (1 + 2 ** -40) if (value > 0) == lower else value * (1 - 2 ** -40)
    schema = {"type": "number", key: value, "maximum" if lower else "minimum": far}
    try:
        llm.make_constraint(json_schema=schema)
    except PyllmError as e:
        assert re.match(r"^invalid json_schema: /(minimum|maximum|exclusiveMinimum|exclusiveMaximum) is ",
                        str(e)), str(e)
        return
    if key.startswith("exclusive"):  # half a unit inside the bound, which reads as the bound
        text = format(Decimal(int(value)) + (Decimal("0.5") if lower else Decimal("-0.5")), "f")
        assert float(text) == value and not accepts(llm, schema, text), text
    sampled_outputs_validate(llm, schema, "A very large number: ", seeds=(1, 2), max_tokens=32)


@pytest.mark.parametrize("schema,inside,outside", [
    ({"type": "number", "minimum": 0, "maximum": 0.9999999999999999}, ["0.9999999999999998", "0"],
     ["1", "1.0", "0.9999999999999999"]),
    ({"type": "number", "minimum": -0.9999999999999999, "maximum": 0}, ["-0.9999999999999998"], ["-1"]),
    # an exclusive bound moved one double inwards lands on such digits: 1 was admitted under exclusiveMaximum 1
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, ["0.9999999999999998", "0.5"],
     ["1", "1.00000000000000000"]),
    # digits that are a double themselves are read exactly and stay
    ({"type": "number", "minimum": 0, "maximum": 0.30000000000000004}, ["0.30000000000000004"],
     ["0.3000000000000001"]),
])
def test_bounds_whose_digits_the_engine_would_round_are_read_exactly(schema, inside, outside):
    """The engine reads a bound's digits as one integer made a double, then scales it: 9999999999999999 is no
    double, so a maximum of 0.9999999999999999 was read as 1 and admitted 1. Reference: jsonschema on json.loads
    of each text; the bound moves inwards to the nearest double whose digits are one (0.9999999999999998)."""
    llm = smollm2()
    validator = jsonschema.Draft202012Validator(schema)
    for text in inside:
        assert accepts(llm, schema, text), (schema, text)
        validator.validate(json.loads(text))
    for text in outside:
        assert not accepts(llm, schema, text), (schema, text)
    sampled_outputs_validate(llm, schema, "A number between 0 and 1: ", max_tokens=32)


@pytest.mark.parametrize("fmt,inside,outside", [
    ("date", ["2024-02-29", "2000-02-29", "0001-01-01", "2023-12-31"], ["2023-02-29", "1900-02-29", "0000-01-01"]),
    ("time", ["23:59:59Z", "00:00:00.5+05:30"], ["23:59:60Z"]),
    ("date-time", ["2024-02-29T12:00:00Z", "2023-01-01t00:00:00z"], ["2023-02-29T12:00:00Z", "2023-06-30T23:59:60Z"]),
])
def test_date_and_time_formats_admit_only_real_dates_and_times(fmt, inside, outside):
    """The engine's date, time and date-time patterns took every month's days up to 29 in any year (2023-02-29),
    year 0000 and the leap second 60. Reference: jsonschema's format checker (Python's date.fromisoformat and
    rfc3339-validator), the output read with Python's json."""
    llm = smollm2()
    schema = {"type": "string", "format": fmt}
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    # jsonschema leaves a format unchecked when its optional checker is missing (the test extra installs it)
    assert fmt in checker.checkers, f"jsonschema has no {fmt!r} format checker: pip install -e '.[test]'"
    for text in inside:
        assert checker.conforms(text, fmt) and accepts(llm, schema, json.dumps(text)), text
    for text in outside:
        assert not checker.conforms(text, fmt) and not accepts(llm, schema, json.dumps(text)), text
    validator = jsonschema.Draft202012Validator(schema, format_checker=checker)
    for seed in (1, 2):
        out = llm.generate(f"A {fmt}: ", json_schema=schema, max_tokens=24, temperature=1, seed=seed)
        if llm.stats.finish_reason == "eog":
            validator.validate(json.loads(out))
