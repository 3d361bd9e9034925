"""Bounds on JSON a client sends: how deep it nests, and what a JSON schema compiled into a grammar may hold.

A schema from a request (response_format's json_schema, guided_json, each tool's parameters) is compiled by the
generation worker into an llguidance grammar. Its cost grows with what the schema holds, not only its size: every
`pattern` and `patternProperties` key becomes a regex the lexer combines with the others, nesting deepens the
grammar (and Python's recursion), and a number past 64 bits is one no grammar library represents. `check_schema`
refuses such a schema in the API, naming the request's field, before any worker sees it. The bounds are settings
(`SchemaBounds.of`).

A schema that passes may still let a small model loop inside an unbounded value (`"population": 1111...` until
max_tokens). `bounded_schema` fills in, wherever the schema leaves them open: `maxLength` on strings (not on a
`format`, `enum` or `const`, bounded already), `minimum` / `maximum` of +-(10**digits - 1) on integers and numbers,
and `multipleOf` 10**-fraction_digits on numbers (llguidance bounds a number's fraction by it); and an object that
names its `properties` but says nothing of others gets `additionalProperties: false` (JSON Schema's default allows
any number of extra keys, each an unbounded string: a Pydantic model's schema loops so on a random model), as
xgrammar's strict mode does, unless subschemas describe one object together (allOf, if/then, properties beside
anyOf/oneOf/$ref). A bound the schema sets itself wins; `not` sub-schemas and data keywords (`enum`, `const`,
`default`, `examples`) are left alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.errors import ValidationFailed

if TYPE_CHECKING:
    from core.settings import Settings

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what a number in a schema must fit (llguidance reads i64 and f64)


def nesting_depth(value: Any) -> int:
    """Depth of nested lists/dicts in a JSON value, level by level without recursion (a scalar is 0)."""
    depth, level = 0, [value]
    while any(isinstance(node, (dict, list)) for node in level):
        depth += 1
        level = [child for node in level if isinstance(node, (dict, list))
                 for child in (node.values() if isinstance(node, dict) else node)]
    return depth


@dataclass(frozen=True)
class SchemaBounds:
    """What one JSON schema sent to be compiled into a grammar may hold."""

    max_bytes: int  # its JSON text
    max_depth: int  # nested objects and arrays
    max_pattern_properties: int  # patternProperties keys, all objects together
    max_patterns: int  # `pattern` keywords, all strings together

    @classmethod
    def of(cls, settings: Settings) -> SchemaBounds:
        """The server's bounds."""
        return cls(max_bytes=settings.max_schema_bytes, max_depth=settings.max_schema_depth,
                   max_pattern_properties=settings.max_schema_pattern_properties,
                   max_patterns=settings.max_schema_patterns)


def check_schema(schema: dict[str, Any], field: str, bounds: SchemaBounds) -> str:
    """The schema as canonical JSON text (sorted keys: one grammar per schema, whatever its key order); a schema past
    a bound is a ValidationFailed naming `field`."""
    if nesting_depth(schema) > bounds.max_depth:  # first: everything below walks the schema
        raise ValidationFailed(field, f"the schema is nested more than {bounds.max_depth} levels deep")
    pattern_properties = patterns = 0
    nodes: list[Any] = [schema]
    while nodes:
        node = nodes.pop()
        if isinstance(node, bool) or node is None or isinstance(node, str):
            continue
        if isinstance(node, int) and not INT64_MIN <= node <= INT64_MAX or isinstance(node, float) \
                and not math.isfinite(node):
            raise ValidationFailed(field, "a number in the schema does not fit 64 bits (a signed integer or a "
                                   "finite double)")
        if isinstance(node, list):
            nodes.extend(node)
        elif isinstance(node, dict):
            if isinstance(node.get("patternProperties"), dict):
                pattern_properties += len(node["patternProperties"])
            # Counted wherever the key holds a string: a property named "pattern" holds a schema, not a string.
            patterns += isinstance(node.get("pattern"), str)
            nodes.extend(node.values())
    if pattern_properties > bounds.max_pattern_properties:
        raise ValidationFailed(field, f"the schema has {pattern_properties} patternProperties; at most "
                               f"{bounds.max_pattern_properties}")
    if patterns > bounds.max_patterns:
        raise ValidationFailed(field, f"the schema has {patterns} pattern keywords; at most {bounds.max_patterns}")
    text = json.dumps(schema, sort_keys=True, ensure_ascii=False)
    try:
        size = len(text.encode())
    except UnicodeEncodeError as exc:  # JSON's "\ud800": half a UTF-16 pair, which the grammar library refuses
        raise ValidationFailed(field, "a string in the schema holds a lone UTF-16 surrogate") from exc
    if size > bounds.max_bytes:
        raise ValidationFailed(field, f"the schema is {size} bytes; at most {bounds.max_bytes}")
    return text


_DATA = frozenset({"enum", "const", "default", "examples", "not"})
_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


_JOINING = frozenset({"allOf", "if", "dependentSchemas", "unevaluatedProperties"})


def bounded_schema(schema: Any, *, max_string_chars: int, max_number_digits: int, max_fraction_digits: int) -> Any:
    """A copy of `schema` with the open string, integer and number bounds filled in, and its objects closed to the
    properties they name (see the module's docstring)."""
    return _bounded(schema, (max_string_chars, max_number_digits, max_fraction_digits), _closable(schema))


def _closable(schema: Any) -> bool:
    """Whether no two subschemas describe one object together (allOf, if/then, `properties` beside anyOf, oneOf or
    $ref): there, a property one names is an extra one to the other, so neither may be closed."""
    nodes = [schema]
    while nodes:
        node = nodes.pop()
        if isinstance(node, list):
            nodes.extend(node)
        elif isinstance(node, dict):
            if _JOINING & node.keys() or "properties" in node and {"anyOf", "oneOf", "$ref"} & node.keys():
                return False
            nodes.extend(node.values())
    return True


def _bounded(schema: Any, bounds: tuple[int, int, int], close: bool) -> Any:
    if isinstance(schema, list):
        return [_bounded(item, bounds, close) for item in schema]
    if not isinstance(schema, dict):
        return schema
    max_string_chars, max_number_digits, max_fraction_digits = bounds
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _MAPS and isinstance(value, dict):  # names to schemas: a property may be called "enum"
            out[key] = {name: _bounded(sub, bounds, close) for name, sub in value.items()}
        else:
            out[key] = value if key in _DATA else _bounded(value, bounds, close)
    if close and isinstance(schema.get("properties"), dict) \
            and not {"additionalProperties", "patternProperties"} & schema.keys():
        out["additionalProperties"] = False
    kind = schema.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else set()
    if "string" in kinds and not {"maxLength", "format", "enum", "const"} & schema.keys():
        out["maxLength"] = max_string_chars
    if kinds & {"integer", "number"} and not {"enum", "const"} & schema.keys():
        largest = 10**max_number_digits - 1
        if not {"minimum", "exclusiveMinimum"} & schema.keys():
            out["minimum"] = -largest
        if not {"maximum", "exclusiveMaximum"} & schema.keys():
            out["maximum"] = largest
        if "number" in kinds and "integer" not in kinds and "multipleOf" not in schema:
            out["multipleOf"] = 10.0**-max_fraction_digits
    return out
