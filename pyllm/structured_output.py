"""Structured output of an OpenAI-style request: its ``response_format`` (or llama-cpp-python's ``grammar`` /
``json_schema``) as the constraint ``generate_tokens`` applies. Completions, chat completions and forced tool calls
build theirs here.
"""

from __future__ import annotations

import inspect

from .errors import BadRequest, PyllmError


def structured_output_kwargs(llm, response_format=None, grammar=None, json_schema=None,
                             param: str | None = None) -> dict:
    """The constraint keyword argument for ``llm.generate_tokens``: ``{"constraint": ...}``, or {} for none.

    response_format {"type": "json_object"} asks for any JSON object; {"type": "json_schema", "json_schema":
    {"schema": ...}} for that schema; {"type": "text"} for nothing. The constraint is built here, when the call is
    made: an invalid or unsatisfiable schema or grammar is a BadRequest naming ``param`` (default: the argument that
    gave it) before anything streams. PyllmError when a constraint is asked of a runtime whose generate_tokens
    cannot apply one."""
    given = "json_schema" if json_schema is not None else "grammar"
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") not in ("text", "json_object",
                                                                                         "json_schema"):
            raise BadRequest("response_format must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                             "response_format")
        kind = response_format["type"]
        if kind == "json_object":
            json_schema = response_format.get("schema") or {"type": "object"}
        elif kind == "json_schema":
            js = response_format.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(js, dict) or not isinstance(schema, (dict, bool, type(None))):
                raise BadRequest("response_format.json_schema must be an object with a \"schema\" object",
                                 "response_format")
            if schema is False:  # a valid JSON schema that nothing matches (``or {}`` would make it "anything")
                raise BadRequest("response_format.json_schema.schema is false, which no output can match",
                                 "response_format")
            json_schema = schema if isinstance(schema, dict) else {}  # true or absent: any JSON value
        if kind != "text":
            given = "response_format"
    kw = {k: v for k, v in (("json_schema", json_schema), ("grammar", grammar)) if v is not None}
    if not kw:
        return {}
    if "constraint" not in inspect.signature(llm.generate_tokens).parameters:
        raise PyllmError(f"structured output unavailable: this pyllm cannot constrain generation "
                         f"({', '.join(kw)} is not supported yet)")
    try:
        constraint = llm.make_constraint(**kw)
        constraint.allowed()  # the first step's mask (kept for it): a grammar that allows no start fails here
        return {"constraint": constraint}
    except PyllmError as e:
        raise BadRequest(str(e), param or given) from None

