"""core.schema_bounds: what a JSON schema compiled into a grammar may hold, each bound at its edge."""

from __future__ import annotations

import json
import math

import pytest

from core.errors import ValidationFailed
from core.schema_bounds import INT64_MAX, INT64_MIN, SchemaBounds, check_schema, nesting_depth
from core.settings import Settings

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
