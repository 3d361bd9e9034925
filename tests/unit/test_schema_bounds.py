"""core.schema_bounds: what a JSON schema compiled into a grammar may hold, each bound at its edge; and the bounds
filled in where a schema leaves strings and numbers open, which the grammar both engines compile enforces (a
schema's own bounds win)."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
from transformers import GPT2TokenizerFast

from app.schemas.chat import ChatCompletionRequest
from app.services.structured import constraint_of
from core.errors import ValidationFailed
from core.paths import GPT2_TOKENIZER_DIR
from core.protocol import Constraint
from core.schema_bounds import INT64_MAX, INT64_MIN, SchemaBounds, bounded_schema, check_schema, nesting_depth
from core.settings import Settings
from worker.engines.generation.sampling.grammar import Grammars

BOUNDS = SchemaBounds(max_bytes=2000, max_depth=8, max_pattern_properties=3, max_patterns=2)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def _refused(schema: dict, needle: str) -> None:
    with pytest.raises(ValidationFailed) as caught:
        check_schema(schema, "tools.3.function.parameters", BOUNDS)
    assert caught.value.field == "tools.3.function.parameters"
    assert needle in caught.value.message


def test_nesting_depth_counts_levels_without_recursion() -> None:
    assert [nesting_depth(v) for v in (1, [], {}, [[1]], {"a": [{"b": 1}]})] == [0, 1, 1, 2, 3]
    deep: object = 1
    for _ in range(100_000):
        deep = [deep]
    assert nesting_depth(deep) == 100_000


def test_the_bounds_are_the_settings() -> None:
    settings = Settings(max_schema_bytes=10, max_schema_depth=2, max_schema_pattern_properties=1,
                        max_schema_patterns=0)
    assert SchemaBounds.of(settings) == SchemaBounds(10, 2, 1, 0)
    assert SchemaBounds.of(Settings()) == SchemaBounds(100_000, 64, 32, 12)


def test_a_schema_at_every_bound_passes_as_canonical_json() -> None:
    schema = {"type": "object", "patternProperties": {"^a": {"type": "string", "pattern": "^x"}, "^b": {}},
              "properties": {"pattern": {"type": "string", "pattern": "^y"},  # a property named "pattern"
                             "deep": _nested(6)},
              "additionalProperties": {"patternProperties": {"^c": {}}}}
    assert nesting_depth(schema) == BOUNDS.max_depth
    assert check_schema(schema, "f", BOUNDS) == json.dumps(schema, sort_keys=True)


@pytest.mark.parametrize(("schema", "needle"), [
    (_nested(9), "nested more than 8"),
    ({"anyOf": [{"patternProperties": {"^a": {}, "^b": {}}}, {"patternProperties": {"^c": {}, "^d": {}}}]},
     "4 patternProperties; at most 3"),
    ({"allOf": [{"pattern": "a"}, {"pattern": "b"}, {"pattern": "c"}]}, "3 pattern keywords; at most 2"),
    ({"description": "x" * 2000}, "bytes; at most 2000"),
    ({"description": "é" * 1000}, "2019 bytes; at most 2000"),  # UTF-8 bytes, not characters
    ({"properties": {"\udfff": {"enum": ["a"]}}}, "lone UTF-16 surrogate"),  # the worker's compile raised
])
def test_one_past_a_bound_is_refused_naming_the_field(schema, needle) -> None:
    _refused(schema, needle)


@pytest.mark.parametrize("number", [INT64_MAX + 1, INT64_MIN - 1, 10**30, -(10**400), math.inf, -math.inf, math.nan])
def test_numbers_past_64_bits_are_refused(number) -> None:
    _refused({"type": "object", "properties": {"n": {"type": "number", "enum": [1, {"x": [number]}]}}}, "64 bits")


def test_numbers_within_64_bits_pass() -> None:
    schema = {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX, "multipleOf": 1e300, "default": True}
    assert check_schema(schema, "f", BOUNDS)


SCHEMA = {"type": "object", "properties": {
    "population": {"type": "integer"}, "name": {"type": "string"}, "share": {"type": "number"},
    "code": {"type": "string", "maxLength": 3}, "big": {"type": "integer", "maximum": 10**18},
    "enum": {"type": ["string", "null"]}}, "required": ["population"], "additionalProperties": False}
VALUE_BOUNDS = {"max_string_chars": 12, "max_number_digits": 16, "max_fraction_digits": 4}


def test_open_bounds_are_filled_and_the_schemas_own_win() -> None:
    bounded = bounded_schema(SCHEMA, **VALUE_BOUNDS)
    props = bounded["properties"]
    assert props["population"] == {"type": "integer", "minimum": -(10**16 - 1), "maximum": 10**16 - 1}
    assert props["name"]["maxLength"] == 12 and props["code"]["maxLength"] == 3  # its own maxLength wins
    assert props["big"]["maximum"] == 10**18 and props["big"]["minimum"] == -(10**16 - 1)
    assert props["share"]["multipleOf"] == 1e-4 and props["enum"]["maxLength"] == 12  # a property named "enum"
    validate = jsonschema.Draft202012Validator(bounded).is_valid
    assert validate({"population": 10**15, "name": "Lyon", "share": 0.25, "big": 10**17})
    assert not validate({"population": int("1" * 40)}) and not validate({"population": 1, "name": "x" * 13})


def test_objects_are_closed_to_their_named_properties_unless_subschemas_join() -> None:
    model = {"type": "object", "properties": {"city": {"type": "string"}, "where": {"anyOf": [
        {"type": "object", "properties": {"lat": {"type": "number"}}}, {"type": "null"}]}}}
    bounded = bounded_schema(model, **VALUE_BOUNDS)  # a Pydantic model's schema: no additionalProperties
    assert bounded["additionalProperties"] is False
    assert bounded["properties"]["where"]["anyOf"][0]["additionalProperties"] is False
    assert bounded_schema({"type": "object"}, **VALUE_BOUNDS) == {"type": "object"}  # names none: stays open
    own = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "integer"}}
    assert bounded_schema(own, **VALUE_BOUNDS)["additionalProperties"] == {
        "type": "integer", "minimum": -(10**16 - 1), "maximum": 10**16 - 1}
    joined = {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]}
    assert all("additionalProperties" not in branch for branch in bounded_schema(joined, **VALUE_BOUNDS)["allOf"])
    beside = {"properties": {"a": {"type": "integer"}}, "oneOf": [{"properties": {"b": {"const": 1}}}]}
    assert "additionalProperties" not in bounded_schema(beside, **VALUE_BOUNDS)


@pytest.fixture(scope="module")
def grammars() -> tuple[Grammars, GPT2TokenizerFast]:
    tokenizer = GPT2TokenizerFast.from_pretrained(GPT2_TOKENIZER_DIR)
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id]), tokenizer


def _accepts(grammars: tuple[Grammars, GPT2TokenizerFast], constraint: Constraint, text: str) -> bool:
    compiled, tokenizer = grammars
    matcher, ids = compiled.matcher(constraint), tokenizer.encode(text)
    if matcher.validate_tokens(ids) < len(ids):
        return False
    matcher.consume_tokens(ids)
    return matcher.is_accepting()


def test_the_request_schema_both_engines_get_refuses_endless_numbers_and_strings(grammars) -> None:
    settings = Settings(structured_max_string_chars=12, structured_max_fraction_digits=4)
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    constraint = constraint_of(body, settings)
    assert constraint is not None and json.loads(constraint.spec)["properties"]["name"]["maxLength"] == 12
    # llguidance keeps the properties' order, alphabetical in the spec (sorted once per schema)
    assert _accepts(grammars, constraint, '{"name":"Lyon","population":1234567890123456,"share":0.25}')
    assert not _accepts(grammars, constraint, '{"population":' + "1" * 40 + "}")
    assert not _accepts(grammars, constraint, '{"name":"' + "x" * 13 + '","population":1}')
    assert not _accepts(grammars, constraint, '{"population":1,"share":0.' + "1" * 20 + "}")
    assert _accepts(grammars, constraint, '{"big":' + "9" * 18 + ',"code":"abc","population":1}')  # own bounds
    assert not _accepts(grammars, constraint, '{"code":"abcd","population":1}')
