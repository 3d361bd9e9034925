"""Bounds added to a structured-output JSON schema so that its output always ends.

A grammar lets a small model loop inside an unbounded value (`"population": 1111...` until max_tokens). Before a
schema reaches either engine it gets, wherever the schema leaves them open: `maxLength` on strings (not on a
`format`, `enum` or `const`, bounded already), `minimum` / `maximum` of +-(10**digits - 1) on integers and numbers,
and `multipleOf` 10**-fraction_digits on numbers (llguidance bounds a number's fraction by it). A bound the schema
sets itself wins; `not` sub-schemas and data keywords (`enum`, `const`, `default`, `examples`) are left alone.
"""

from __future__ import annotations

from typing import Any

_DATA = frozenset({"enum", "const", "default", "examples", "not"})
_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def bounded_schema(schema: Any, *, max_string_chars: int, max_number_digits: int, max_fraction_digits: int) -> Any:
    """A copy of `schema` with the open string, integer and number bounds filled in (see the module's docstring)."""
    if isinstance(schema, list):
        return [bounded_schema(item, max_string_chars=max_string_chars, max_number_digits=max_number_digits,
                               max_fraction_digits=max_fraction_digits) for item in schema]
    if not isinstance(schema, dict):
        return schema
    def bound(value: Any) -> Any:
        return bounded_schema(value, max_string_chars=max_string_chars, max_number_digits=max_number_digits,
                              max_fraction_digits=max_fraction_digits)

    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _MAPS and isinstance(value, dict):  # names to schemas: a property may be called "enum"
            out[key] = {name: bound(sub) for name, sub in value.items()}
        else:
            out[key] = value if key in _DATA else bound(value)
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
