"""Structured output on the /v1 routes: response_format, guided_choice and guided_regex as one Constraint.

The worker compiles the constraint (llguidance, see worker/engines/generation/sampling/grammar.py); a schema it cannot
enforce comes back as a 422 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from app.schemas.structured import StructuredFields
from core.errors import ValidationFailed
from core.protocol import Constraint
from core.schema_bounds import bounded_schema
from core.settings import Settings


def constraint_of(body: StructuredFields, settings: Settings) -> Constraint | None:
    """The one output constraint a request asks for (response_format, guided_choice or guided_regex), if any; a JSON
    schema gets the settings' bounds where it leaves strings and numbers open (core/schema_bounds.py)."""
    given = [name for name in ("response_format", "guided_choice", "guided_regex") if getattr(body, name) is not None]
    if len(given) > 1:
        raise ValidationFailed(given[1], f"give at most one of {', '.join(given)}")
    if body.guided_choice is not None:
        if not body.guided_choice or any(not c for c in body.guided_choice) or len(body.guided_choice) > 1000:
            raise ValidationFailed("guided_choice", "1-1000 non-empty strings")
        return Constraint(kind="choice", spec=json.dumps(body.guided_choice))
    if body.guided_regex is not None:
        if not body.guided_regex:
            raise ValidationFailed("guided_regex", "the regex is empty")
        return Constraint(kind="regex", spec=body.guided_regex)
    return _response_format(body.response_format, settings)


def _response_format(value: dict[str, Any] | None, settings: Settings) -> Constraint | None:
    kind = None if value is None else value.get("type")
    if value is None or kind == "text":
        return None
    if kind == "json_object":
        return Constraint(kind="json_object")
    if kind != "json_schema":
        raise ValidationFailed("response_format", "type must be text, json_object or json_schema")
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ValidationFailed("response_format", 'json_schema needs {"name": ..., "schema": {...}}')
    if len(json.dumps(schema)) > 100_000:
        raise ValidationFailed("response_format", "the schema is larger than 100 kB")
    schema = bounded_schema(schema, max_string_chars=settings.structured_max_string_chars,
                            max_number_digits=settings.structured_max_number_digits,
                            max_fraction_digits=settings.structured_max_fraction_digits)
    text = json.dumps(schema, sort_keys=True)  # one cache entry per schema, whatever its key order
    return Constraint(kind="json_schema", spec=text)
