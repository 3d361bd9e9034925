"""Structured output on the /v1 routes: response_format, guided_json, guided_choice and guided_regex as one Constraint.

The worker compiles the constraint (llguidance, see worker/engines/generation/sampling/grammar.py); a schema past the
server's bounds (core/schema_bounds.py) is refused here, and one the worker cannot enforce comes back as a 422, each
naming the field. A schema that passes gets the settings' bounds where it leaves strings and numbers open, so its
output always ends; both engines compile that bounded schema.
"""

from __future__ import annotations

import json
from typing import Any

from app.schemas.structured import StructuredFields
from core.errors import ValidationFailed
from core.protocol import Constraint, ValueBounds
from core.schema_bounds import SchemaBounds, bounded_schema, check_schema
from core.settings import Settings

SCHEMA_FIELD = "response_format.json_schema.schema"


def constraint_of(body: StructuredFields, settings: Settings) -> Constraint | None:
    """The one output constraint a request asks for (response_format, guided_json, guided_choice or guided_regex)."""
    given = [name for name in ("response_format", "guided_json", "guided_choice", "guided_regex")
             if getattr(body, name) is not None]
    if len(given) > 1:
        raise ValidationFailed(given[1], f"give at most one of {', '.join(given)}")
    if body.guided_json is not None:
        return _guided_json(body.guided_json, settings)
    if body.guided_choice is not None:
        if not body.guided_choice or any(not c for c in body.guided_choice) or len(body.guided_choice) > 1000:
            raise ValidationFailed("guided_choice", "1-1000 non-empty strings")
        return Constraint(kind="choice", spec=json.dumps(body.guided_choice))
    if body.guided_regex is not None:
        if not body.guided_regex:
            raise ValidationFailed("guided_regex", "the regex is empty")
        return Constraint(kind="regex", spec=body.guided_regex)
    return _response_format(body.response_format, settings)


def _schema_spec(schema: dict[str, Any], field: str, settings: Settings) -> str:
    """The schema checked against the server's bounds (a 422 naming `field`), its open values bounded, as canonical
    JSON text (sorted keys: one grammar per schema, whatever its key order)."""
    check_schema(schema, field, SchemaBounds.of(settings))  # first: bounded_schema walks it recursively
    bounded = bounded_schema(schema, **ValueBounds.of(settings).model_dump())
    return json.dumps(bounded, sort_keys=True, ensure_ascii=False)


def _guided_json(value: dict[str, Any] | str, settings: Settings) -> Constraint:
    """vLLM's guided_json: a JSON schema, as an object or as its JSON text."""
    schema: Any = value
    if isinstance(value, str):
        if len(value) > settings.max_schema_bytes:
            raise ValidationFailed("guided_json", f"the schema is larger than {settings.max_schema_bytes} bytes")
        try:
            schema = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise ValidationFailed("guided_json", "guided_json is a JSON schema, as an object or JSON text") from exc
    if not isinstance(schema, dict):
        raise ValidationFailed("guided_json", "guided_json is a JSON schema object")
    return Constraint(kind="json_schema", spec=_schema_spec(schema, "guided_json", settings), field="guided_json")


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
    return Constraint(kind="json_schema", spec=_schema_spec(schema, SCHEMA_FIELD, settings))
