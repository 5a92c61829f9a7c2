"""A missing "additionalProperties" reads as false, as llama.cpp's json-schema-to-grammar reads it (and so Ollama
and llama-cpp-python): a pydantic model's schema, which never writes it, keeps the model to the model's fields.

References: the ``jsonschema`` package (Draft 2020-12) on each text against the schema with
"additionalProperties": false written out by hand where pyllm reads it so (or as given where pyllm leaves the
object open); pydantic's own ``model_validate_json`` on generated output. Generation: smollm2, greedy.
"""

import json
import subprocess
import sys
from enum import Enum
from typing import Annotated, List, Optional

import pytest

jsonschema = pytest.importorskip("jsonschema")  # in the test extra; CI installs it
pydantic = pytest.importorskip("pydantic")  # in the test extra

from server_harness import served_in_thread  # noqa: E402
from test_structured_schemas import accepts, smollm2  # noqa: E402

A = {"a": {"type": "integer"}}
B = {"b": {"type": "string"}}


def closed_everywhere(schema):
    """``schema`` with "additionalProperties": false on every subschema that lists properties and says nothing
    of it: the reading the peers give a pydantic schema."""
    if isinstance(schema, list):
        return [closed_everywhere(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in ("enum", "const", "default", "examples") else closed_everywhere(v)
           for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict):
        out.setdefault("additionalProperties", False)
    return out


@pytest.mark.parametrize("schema,reference,texts", [
    # no additionalProperties: false, so an invented key is refused
    ({"type": "object", "properties": A, "required": ["a"]},
     {"type": "object", "properties": A, "required": ["a"], "additionalProperties": False},
     ['{"a": 1}', '{"a": 1, "b": 2}']),
    # true, or a schema, still admits other keys
    ({"type": "object", "properties": A, "additionalProperties": True}, None, ['{"a": 1, "b": 2}', '{"a": 1}']),
    ({"type": "object", "properties": A, "additionalProperties": {"type": "integer"}}, None,
     ['{"a": 1, "b": 2}', '{"a": 1, "b": "x"}']),
    # an object without "properties" stays any object
    ({"type": "object"}, None, ['{"b": 2}', '{}']),
    # a definition reached through $ref is closed where it is referenced, and so is the object around it
    ({"$defs": {"P": {"type": "object", "properties": A}}, "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}},
     {"$defs": {"P": {"type": "object", "properties": A, "additionalProperties": False}}, "type": "object",
      "properties": {"p": {"$ref": "#/$defs/P"}}, "additionalProperties": False},
     ['{"p": {"a": 1}}', '{"p": {"a": 1, "c": 2}}', '{"p": {"a": 1}, "q": 1}']),
    # each anyOf branch on its own (pydantic's Union of two models)
    ({"anyOf": [{"properties": A, "required": ["a"]}, {"properties": B, "required": ["b"]}]},
     {"anyOf": [{"properties": A, "required": ["a"], "additionalProperties": False},
                {"properties": B, "required": ["b"], "additionalProperties": False}]},
     ['{"a": 1}', '{"b": "x"}', '{"a": 1, "b": "x"}']),
    # patternProperties keys are not additional ones
    ({"type": "object", "properties": A, "patternProperties": {"^x": {"type": "integer"}}},
     {"type": "object", "properties": A, "patternProperties": {"^x": {"type": "integer"}},
      "additionalProperties": False},
     ['{"a": 1, "x1": 2}', '{"a": 1, "y": 2}']),
    # names from two allOf members: closing each would refuse the other's, so the object stays as written
    ({"allOf": [{"properties": A}, {"properties": B}]}, None, ['{"a": 1, "b": "x"}', '{"a": 1, "c": 3}']),
], ids=["absent", "true", "schema", "no-properties", "ref", "anyOf", "patternProperties", "allOf"])
def test_a_missing_additional_properties_is_false(schema, reference, texts):
    """Reference: jsonschema on each text against ``reference`` (the schema as given where it is None)."""
    llm = smollm2()
    given = json.dumps(schema)
    validator = jsonschema.Draft202012Validator(reference or schema)
    for text in texts:
        assert accepts(llm, schema, text) == validator.is_valid(json.loads(text)), (schema, text)
    assert json.dumps(schema) == given  # the caller's schema is not edited
    if reference is not None:  # the case is one where JSON Schema's own default would admit more
        plain = jsonschema.Draft202012Validator(schema)
        assert any(plain.is_valid(json.loads(t)) != validator.is_valid(json.loads(t)) for t in texts)


class Color(str, Enum):
    red = "red"
    blue = "blue"


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=16)
    zip: Optional[str] = pydantic.Field(default=None, max_length=5)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)
    color: Color
    address: Address
    nick: Optional[str] = pydantic.Field(default=None, max_length=8)
    tags: List[Annotated[str, pydantic.StringConstraints(max_length=12)]] = pydantic.Field(default=[], max_length=2)


def check_person(text: str):
    """The reply validates as the peers read the schema, and as pydantic reads it."""
    schema = Person.model_json_schema()
    jsonschema.Draft202012Validator(closed_everywhere(schema)).validate(json.loads(text))
    Person.model_validate_json(text)


def test_a_pydantic_schema_as_given_keeps_the_model_to_its_fields():
    """model_json_schema() ($defs and $ref, titles, Optional as anyOf with null, an enum, a nested model, a list)
    through llm.chat(json_schema=...), greedy. The schema has no additionalProperties anywhere; the reply must
    validate with every object closed."""
    schema = Person.model_json_schema()
    assert "additionalProperties" not in json.dumps(schema)
    llm = smollm2()
    reply = llm.chat([{"role": "user", "content": "Invent a person. Answer in JSON."}], json_schema=schema,
                     temperature=0, max_tokens=160)
    assert llm.stats.finish_reason == "eog", reply
    check_person(reply)


def test_cli_json_schema_file_from_pydantic(tmp_path, smollm2_path):
    """`pyllm run --json-schema FILE` with the pydantic schema written to the file as is."""
    path = tmp_path / "person.schema.json"
    path.write_text(json.dumps(Person.model_json_schema()))
    res = subprocess.run([sys.executable, "-m", "pyllm", "run", smollm2_path, "Invent a person. Answer in JSON.",
                          "--chat", "--json-schema", str(path), "--temp", "0", "-n", "160"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    check_person(res.stdout)


def test_response_format_with_a_pydantic_schema_over_http():
    """The OpenAI server's response_format {"type": "json_schema"} with the pydantic schema as given, through the
    official openai client."""
    import openai

    from pyllm.server.app import create_app

    llm = smollm2()
    with served_in_thread(create_app(llm, "smollm2")) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Invent a person. Answer in JSON."}],
            temperature=0, max_tokens=160,
            response_format={"type": "json_schema", "json_schema": {"name": "person",
                                                                    "schema": Person.model_json_schema()}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    check_person(r.choices[0].message.content)


def test_ollama_format_is_the_same_conversion():
    """Ollama's ``format`` ("json", or a schema) becomes the same structured-output arguments the OpenAI routes
    pass (server/ollama.py), so the same reading applies: a schema without additionalProperties refuses an invented
    key; "json" is any object. Reference: jsonschema's reading, as above."""
    from pyllm.errors import BadRequest
    from pyllm.server.ollama import _format_kwargs
    from pyllm.structured_output import structured_output_kwargs

    llm = smollm2()

    def takes(fmt, text):
        c = structured_output_kwargs(llm, **_format_kwargs(fmt))["constraint"]
        for t in llm.tokenize(text, add_bos=False, special=False):
            if not c.allowed()[t]:
                return False
            c.advance(t)
        return c.is_accepting()

    schema = {"type": "object", "properties": A, "required": ["a"]}
    assert takes(schema, '{"a": 1}') and not takes(schema, '{"a": 1, "b": 2}')
    assert takes("json", '{"b": [1]}') and not takes("json", "[1]")
    assert _format_kwargs(None) == {} and _format_kwargs("") == {}
    for bad in ("yaml", 3):
        with pytest.raises(BadRequest) as e:
            _format_kwargs(bad)
        assert e.value.param == "format" and "\n" not in str(e.value)
