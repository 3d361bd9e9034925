"""JSON Schema checks for the json_schema grader (and its own validation when created)."""

from __future__ import annotations

import json
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError


def check_schema(schema: dict[str, Any]) -> None:
    """Refuse (ValueError) a schema that is not valid JSON Schema 2020-12."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise ValueError(f"schema is not valid JSON Schema: {exc.message}") from exc


def schema_errors(text: str, schema: dict[str, Any]) -> str | None:
    """Why `text` is not JSON that `schema` accepts (None when it is)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    error = next(iter(Draft202012Validator(schema).iter_errors(value)), None)
    return None if error is None else error.message
