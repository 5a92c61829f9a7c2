"""Held-out sweep of JSON-schema constrained generation against the ``jsonschema`` package (Draft 2020-12, with
its format checker): for each schema below, pyllm either refuses it up front with one line, or every finished
sample at temperature 1 validates once read with Python's json. Samples that hit max_tokens are counted apart
(unfinished, not checked); a generation past --seconds is abandoned.

    python tools/schema_sweep.py                      # every schema, 3 seeds, smollm2-135m
    python tools/schema_sweep.py --seeds 5 nested enum_mixed   # named schemas only

Exits non-zero when any finished output fails validation or a call fails other than by refusal; an output the
reference cannot check (a pattern with \\p{L}, which Python's re lacks) is counted as unchecked. The schemas
cover the JSON Schema Test Suite's feature families the engine implements (nested objects, arrays and
prefixItems, enum / const of mixed types, patterns, formats, additional / pattern properties, anyOf / oneOf,
recursive $defs, multipleOf, numbers far from and close to double precision) and some it does not (refused).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

import jsonschema

import pyllm
from pyllm import PyllmError

B53 = 2 ** 53
SCHEMAS: list[tuple[str, dict]] = []


def add(name: str, schema: dict) -> None:
    SCHEMAS.append((name, schema))


add('nested',
    {'type': 'object',
     'properties': {'user': {'type': 'object',
                             'properties': {'name': {'type': 'string', 'maxLength': 10},
                                            'tags': {'type': 'array',
                                                     'items': {'type': 'string', 'maxLength': 6},
                                                     'maxItems': 3}},
                             'required': ['name', 'tags'],
                             'additionalProperties': False}},
     'required': ['user'],
     'additionalProperties': False})
add('arr_min_max',
    {'type': 'array', 'items': {'type': 'integer', 'minimum': 0, 'maximum': 9}, 'minItems': 2, 'maxItems': 4})
add('arr_unique',
    {'type': 'array', 'items': {'type': 'integer', 'minimum': 0, 'maximum': 3}, 'uniqueItems': True, 'maxItems': 3})
add('arr_unique_bool', {'type': 'array', 'items': {'type': 'boolean'}, 'uniqueItems': True})
add('prefix',
    {'type': 'array',
     'prefixItems': [{'type': 'string', 'maxLength': 5}, {'type': 'integer'}, {'type': 'boolean'}],
     'items': False,
     'minItems': 3})
add('prefix_open', {'type': 'array', 'prefixItems': [{'const': 'x'}], 'items': {'type': 'null'}, 'maxItems': 3})
add('enum_mixed', {'enum': ['a', 1, 2.5, None, True, {'k': [1, 2]}, [1, 'x']]})
add('const_obj', {'const': {'a': [1, {'b': None}], 'c': 'é'}})
add('const_str_unicode', {'const': '日本é"\\'})
add('pattern_anch', {'type': 'string', 'pattern': '^[a-z]{2,4}-[0-9]{3}$'})
add('pattern_unanch', {'type': 'string', 'pattern': 'ab+c', 'maxLength': 12})
add('pattern_unicode', {'type': 'string', 'pattern': '^[α-ω]+$', 'maxLength': 8})
add('pattern_unicode_class', {'type': 'string', 'pattern': '^\\p{L}+$', 'maxLength': 8})
add('pattern_dollar_mid', {'type': 'string', 'pattern': '^a|b$', 'maxLength': 8})
add('pattern_digit', {'type': 'string', 'pattern': '^\\d+$', 'maxLength': 6})
add('pattern_w', {'type': 'string', 'pattern': '^\\w{1,5}$'})
add('format_date', {'type': 'string', 'format': 'date'})
add('format_date-time', {'type': 'string', 'format': 'date-time'})
add('format_time', {'type': 'string', 'format': 'time'})
add('format_email', {'type': 'string', 'format': 'email'})
add('format_uuid', {'type': 'string', 'format': 'uuid'})
add('format_ipv4', {'type': 'string', 'format': 'ipv4'})
add('format_ipv6', {'type': 'string', 'format': 'ipv6'})
add('format_hostname', {'type': 'string', 'format': 'hostname'})
add('format_uri', {'type': 'string', 'format': 'uri'})
add('format_duration', {'type': 'string', 'format': 'duration'})
add('addl_false', {'type': 'object', 'properties': {'a': {'type': 'integer'}}, 'additionalProperties': False})
add('addl_schema',
    {'type': 'object',
     'properties': {'a': {'type': 'integer'}},
     'additionalProperties': {'type': 'boolean'},
     'maxProperties': 3})
add('pattern_props',
    {'type': 'object',
     'patternProperties': {'^x_': {'type': 'integer'}, '^y_': {'type': 'string', 'maxLength': 3}},
     'additionalProperties': False,
     'maxProperties': 3})
add('pattern_props_named',
    {'type': 'object',
     'properties': {'x_a': {'type': 'integer', 'minimum': 5}},
     'patternProperties': {'^x_': {'type': 'integer', 'maximum': 7}},
     'additionalProperties': False})
add('dependentRequired',
    {'type': 'object',
     'properties': {'a': {'type': 'integer'}, 'b': {'type': 'integer'}},
     'dependentRequired': {'a': ['b']}})
add('if_then_else',
    {'type': 'object',
     'properties': {'k': {'enum': ['x', 'y']}, 'v': {}},
     'required': ['k', 'v'],
     'if': {'properties': {'k': {'const': 'x'}}},
     'then': {'properties': {'v': {'type': 'integer'}}},
     'else': {'properties': {'v': {'type': 'string'}}}})
add('not', {'type': 'integer', 'not': {'const': 3}, 'minimum': 0, 'maximum': 5})
add('nullable_union', {'type': ['string', 'null'], 'maxLength': 5})
add('anyof_null', {'anyOf': [{'type': 'integer', 'minimum': 0}, {'type': 'null'}]})
add('oneof_disjoint', {'oneOf': [{'type': 'integer'}, {'type': 'string', 'maxLength': 3}]})
add('oneof_overlap', {'oneOf': [{'type': 'integer'}, {'type': 'number'}]})
add('recursive',
    {'$defs': {'node': {'type': 'object',
                        'properties': {'v': {'type': 'integer'},
                                       'kids': {'type': 'array', 'items': {'$ref': '#/$defs/node'}, 'maxItems': 2}},
                        'required': ['v'],
                        'additionalProperties': False}},
     '$ref': '#/$defs/node'})
add('recursive_root',
    {'type': 'object',
     'properties': {'n': {'type': 'integer'}, 'next': {'anyOf': [{'$ref': '#'}, {'type': 'null'}]}},
     'required': ['n', 'next'],
     'additionalProperties': False})
add('int_multiple', {'type': 'integer', 'multipleOf': 7, 'minimum': -50, 'maximum': 50})
add('int_multiple_open', {'type': 'integer', 'multipleOf': 3})
add('num_multiple', {'type': 'number', 'multipleOf': 0.25, 'minimum': 0, 'maximum': 2})
add('num_multiple_odd', {'type': 'number', 'multipleOf': 0.1})
add('int_big', {'type': 'integer', 'minimum': 100000000000000000, 'maximum': 1000000000000000000})
add('num_small', {'type': 'number', 'minimum': 1e-10, 'maximum': 1e-08})
add('num_neg_small', {'type': 'number', 'exclusiveMaximum': 0, 'exclusiveMinimum': -1e-05})
add('num_big_excl', {'type': 'number', 'exclusiveMaximum': -3e+17})
add('num_big_incl', {'type': 'number', 'minimum': 3e+17, 'maximum': 3.00000000000001e+17})
add('num_b53_excl_min', {'type': 'number', 'exclusiveMinimum': 9007199254740992})
add('num_1e300', {'type': 'number', 'maximum': 1e+300, 'minimum': -1e+300})
add('num_1e16_max', {'type': 'number', 'maximum': 1e+16})
add('num_excl_max_1', {'type': 'number', 'exclusiveMaximum': 1, 'exclusiveMinimum': 0})
add('num_tiny_excl', {'type': 'number', 'exclusiveMinimum': 0, 'maximum': 5e-324})
add('int_excl', {'type': 'integer', 'exclusiveMinimum': 0, 'exclusiveMaximum': 3})
add('num_float_bound', {'type': 'number', 'minimum': 0.1, 'maximum': 0.3})
add('minProps_allof',
    {'type': 'object',
     'properties': {'a': {'type': 'integer'}, 'b': {'type': 'integer'}},
     'allOf': [{'required': ['a', 'b']}],
     'minProperties': 2})
add('minProps_ref',
    {'$defs': {'R': {'required': ['a']}},
     'type': 'object',
     'properties': {'a': {'type': 'integer'}},
     '$ref': '#/$defs/R',
     'minProperties': 1})
add('maxProps_addl', {'type': 'object', 'additionalProperties': {'type': 'integer'}, 'maxProperties': 2})
add('minProps_closed',
    {'type': 'object',
     'properties': {'a': {'type': 'integer'}, 'b': {'type': 'integer'}},
     'additionalProperties': False,
     'minProperties': 1})
add('str_lengths', {'type': 'string', 'minLength': 3, 'maxLength': 3})
add('str_empty', {'type': 'string', 'maxLength': 0})
add('str_unicode_len', {'type': 'string', 'minLength': 2, 'maxLength': 2, 'pattern': '^[^a-z]*$'})
add('allof_types',
    {'allOf': [{'type': ['integer', 'string']}, {'type': ['integer', 'null']}], 'minimum': 3, 'maximum': 4})
add('allof_objs',
    {'allOf': [{'type': 'object', 'properties': {'a': {'type': 'integer'}}, 'required': ['a']},
               {'properties': {'b': {'type': 'string', 'maxLength': 2}}, 'required': ['b']}],
     'additionalProperties': False})
add('items_false', {'type': 'array', 'items': False})
add('empty_enum_obj', {'type': 'object', 'properties': {'e': {'enum': [[], {}]}}, 'required': ['e']})
add('nested_arrays',
    {'type': 'array',
     'items': {'type': 'array', 'items': {'type': 'number', 'minimum': -1, 'maximum': 1}, 'maxItems': 3},
     'maxItems': 3})
add('required_not_named',
    {'type': 'object', 'required': ['zz'], 'additionalProperties': {'type': 'integer'}, 'maxProperties': 1})
add('bool_schema_prop', {'type': 'object', 'properties': {'a': True, 'b': False}, 'maxProperties': 2})
add('string_escape_pattern', {'type': 'string', 'pattern': '^"\\\\$'})
add('contains', {'type': 'array', 'contains': {'const': 1}})
add('propertyNames', {'type': 'object', 'propertyNames': {'maxLength': 2}})
add('const_big_float', {'const': 1e+300})
add('enum_floats', {'enum': [0.1, 1e-07, 1e+21, -0.0]})
add('num_excl_both_close', {'type': 'number', 'exclusiveMinimum': 0.1, 'exclusiveMaximum': 0.10000000000000002})
add('int_neg_bounds', {'type': 'integer', 'minimum': -9007199254741002, 'maximum': -9007199254740992})
add('num_neg_big_max', {'type': 'number', 'maximum': -1e+20, 'minimum': -2e+20})
add('num_pos_big_excl_min', {'type': 'number', 'exclusiveMinimum': 1e+17, 'maximum': 2e+17})
add('num_b53_max', {'type': 'number', 'maximum': 9007199254740992, 'minimum': 9007199254740988})
add('num_1e18_excl', {'type': 'number', 'exclusiveMaximum': 1e+18, 'minimum': 9e+17})
add('dt_in_obj',
    {'type': 'object',
     'properties': {'when': {'type': 'string', 'format': 'date-time'}, 'id': {'type': 'string', 'format': 'uuid'}},
     'required': ['when', 'id'],
     'additionalProperties': False})
add('both_excl_frac', {'type': ['integer', 'number'], 'exclusiveMinimum': 0.5, 'exclusiveMaximum': 2.5})
add('int_excl_frac', {'type': 'integer', 'exclusiveMinimum': 0.5, 'exclusiveMaximum': 3.5})
add('num_mult_bounds', {'type': 'number', 'multipleOf': 0.5, 'exclusiveMinimum': -2, 'maximum': 2})
add('num_mult_01', {'type': 'number', 'multipleOf': 0.01, 'minimum': 0, 'maximum': 1})
add('int_mult_big', {'type': 'integer', 'multipleOf': 1000, 'minimum': 1000000000000000, 'maximum': 1000000001000000})
add('str_maxlen_unicode', {'type': 'string', 'maxLength': 3, 'minLength': 1})
add('str_minlen_escape', {'type': 'string', 'minLength': 4, 'maxLength': 4, 'pattern': '^[^a-zA-Z0-9 ]*$'})
add('pattern_quote', {'type': 'string', 'pattern': '^["\\\\]{1,3}$'})
add('pattern_newline', {'type': 'string', 'pattern': '^a\\nb$'})
add('pattern_dot', {'type': 'string', 'pattern': '^.{3}$'})
add('pattern_emoji', {'type': 'string', 'pattern': '^[😀-😂]{1,2}$'})
add('enum_unicode_str', {'enum': ['é', 'é́', '"q"', 'a\\b', '\n']})
add('const_neg_zero', {'const': -0.0})
add('const_small', {'const': 1e-07})
add('enum_numbers', {'enum': [1, 1.5, 100000000000000000000, -2]})
add('addl_required_all',
    {'type': 'object',
     'properties': {'a': {'type': 'integer'}},
     'required': ['a'],
     'additionalProperties': {'type': 'integer'},
     'minProperties': 1,
     'maxProperties': 3})
add('pattern_overlap_named',
    {'type': 'object',
     'properties': {'ab': {'type': 'string', 'maxLength': 2}},
     'patternProperties': {'^a': {'type': 'string', 'minLength': 1}},
     'required': ['ab'],
     'additionalProperties': False})
add('anyof_objects',
    {'anyOf': [{'type': 'object',
                'properties': {'k': {'const': 'a'}, 'x': {'type': 'integer'}},
                'required': ['k', 'x'],
                'additionalProperties': False},
               {'type': 'object',
                'properties': {'k': {'const': 'b'}, 'y': {'type': 'string', 'maxLength': 4}},
                'required': ['k', 'y'],
                'additionalProperties': False}]})
add('oneof_const_disc',
    {'oneOf': [{'type': 'object',
                'properties': {'t': {'const': 1}, 'v': {'type': 'integer'}},
                'required': ['t', 'v']},
               {'type': 'object',
                'properties': {'t': {'const': 2}, 'v': {'type': 'string', 'maxLength': 3}},
                'required': ['t', 'v']}]})
add('ref_siblings',
    {'$defs': {'P': {'type': 'object', 'properties': {'n': {'type': 'integer', 'minimum': 0}}, 'required': ['n']}},
     '$ref': '#/$defs/P',
     'properties': {'n': {'maximum': 5}},
     'additionalProperties': False})
add('definitions_ref',
    {'definitions': {'s': {'type': 'string', 'maxLength': 5}},
     'type': 'array',
     'items': {'$ref': '#/definitions/s'},
     'maxItems': 3})
add('prefix_minitems_unsat', {'type': 'array', 'prefixItems': [{'type': 'integer'}], 'items': False, 'minItems': 2})
add('max_items_0', {'type': 'array', 'maxItems': 0})
add('array_of_enums', {'type': 'array', 'items': {'enum': ['x', 'y', None]}, 'minItems': 3, 'maxItems': 3})
add('deep_nest',
    {'type': 'object',
     'properties': {'a': {'type': 'object',
                          'properties': {'b': {'type': 'object',
                                               'properties': {'c': {'type': 'array',
                                                                    'items': {'type': 'object',
                                                                              'properties': {'d': {'type': 'boolean'}},
                                                                              'required': ['d'],
                                                                              'additionalProperties': False},
                                                                    'maxItems': 2}},
                                               'required': ['c'],
                                               'additionalProperties': False}},
                          'required': ['b'],
                          'additionalProperties': False}},
     'required': ['a'],
     'additionalProperties': False})
add('format_date_obj',
    {'type': 'object',
     'properties': {'d': {'type': 'string', 'format': 'date'},
                    'ip': {'type': 'string', 'format': 'ipv4'},
                    'e': {'type': 'string', 'format': 'email', 'maxLength': 30}},
     'required': ['d', 'ip', 'e'],
     'additionalProperties': False})
add('nullable_num', {'type': ['number', 'null'], 'minimum': -1, 'exclusiveMaximum': 1})
add('num_17digit_min', {'type': 'number', 'minimum': 0.12345678901234568, 'maximum': 0.2})
add('num_max_0999', {'type': 'number', 'maximum': 0.9999999999999999, 'minimum': 0.99})
add('num_excl_min_1e_minus5', {'type': 'number', 'exclusiveMinimum': 1e-05, 'maximum': 2e-05})
add('int_neg_excl', {'type': 'integer', 'exclusiveMaximum': -9007199254740992, 'minimum': -9007199254741092})
add('num_large_incl', {'type': 'number', 'minimum': -4611686018427387904, 'maximum': -2305843009213693952})
add('num_both_far', {'type': 'number', 'exclusiveMinimum': 1000000000000000.0, 'exclusiveMaximum': 1000000000000000.2})
add('num_1e15_frac', {'type': 'number', 'exclusiveMinimum': 123456789012345.6, 'maximum': 123456789012346})
add('allof_minmax_items', {'type': 'array', 'allOf': [{'minItems': 2}, {'maxItems': 2}], 'items': {'type': 'boolean'}})
add('minprops_addl_closed_patterns',
    {'type': 'object',
     'patternProperties': {'^k$': {'type': 'integer'}},
     'additionalProperties': False,
     'minProperties': 1})
add('minprops_allof_pattern',
    {'type': 'object',
     'allOf': [{'properties': {'a': {'type': 'integer'}}, 'required': ['a']}],
     'minProperties': 1,
     'additionalProperties': {'type': 'string', 'maxLength': 3}})
add('required_only_names', {'type': 'object', 'required': ['x', 'y'], 'minProperties': 2, 'maxProperties': 2})
add('empty_schema', {})
add('true_items', {'type': 'array', 'items': True, 'maxItems': 2})
add('string_const_long', {'const': 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'})
add('exclusive_int_float_both',
    {'type': ['integer', 'number'], 'exclusiveMaximum': 18014398509481984, 'minimum': 18014398509481884})

class _Timeout(Exception):
    pass


def _alarm(*_):
    raise _Timeout


def sweep(llm, schemas, seeds, max_tokens, seconds) -> dict:
    """Totals over ``schemas``; prints one line per refusal, unfinished sample and failure."""
    tot = dict(tried=0, accepted=0, refused=0, outputs=0, validated=0, unfinished=0, unchecked=0, invalid=0,
               errors=0)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    signal.signal(signal.SIGALRM, _alarm)
    for name, schema in schemas:
        tot["tried"] += 1
        validator = jsonschema.Draft202012Validator(schema, format_checker=checker)
        try:
            llm.make_constraint(json_schema=schema)
        except PyllmError as e:
            tot["refused"] += 1
            print(f"refused   {name}: {e}", flush=True)
            continue
        tot["accepted"] += 1
        for seed in seeds:
            signal.alarm(seconds)
            try:
                out = llm.generate("Here is a JSON value:\n", json_schema=schema, max_tokens=max_tokens,
                                   temperature=1, seed=seed)
            except _Timeout:
                tot["errors"] += 1
                print(f"TIMEOUT   {name} seed {seed}", flush=True)
                continue
            except Exception as e:  # noqa: BLE001 - any other failure is a finding
                tot["errors"] += 1
                print(f"ERROR     {name} seed {seed}: {e!r}", flush=True)
                continue
            finally:
                signal.alarm(0)
            tot["outputs"] += 1
            if llm.stats.finish_reason != "eog":
                tot["unfinished"] += 1
                print(f"unfinished {name} seed {seed}: {out[:80]!r}", flush=True)
                continue
            try:
                validator.validate(json.loads(out))
                tot["validated"] += 1
            except (ValueError, jsonschema.ValidationError) as e:
                tot["invalid"] += 1
                print(f"INVALID   {name} seed {seed}: {out[:120]!r}: {str(e).splitlines()[0]}", flush=True)
            except Exception as e:  # noqa: BLE001 - the reference cannot check it (a pattern Python's re lacks)
                tot["unchecked"] += 1
                print(f"UNCHECKED {name} seed {seed}: {out[:80]!r}: {e}", flush=True)
    return tot


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="schemas to run (default: all)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--seconds", type=int, default=60, help="time limit per generation")
    args = p.parse_args(argv)
    known = dict(SCHEMAS)
    unknown = [n for n in args.names if n not in known]
    if unknown:
        p.error(f"no schema named {', '.join(unknown)}")
    chosen = [(n, known[n]) for n in args.names] if args.names else SCHEMAS
    tot = sweep(pyllm.load(args.model), chosen, range(args.seeds), args.max_tokens, args.seconds)
    print("totals", json.dumps(tot))
    return 1 if tot["invalid"] or tot["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
