"""The structured-output fields /v1/completions and /v1/chat/completions share."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class StructuredFields(BaseModel):
    """response_format (OpenAI) and vLLM's guided_json / guided_choice / guided_regex extra body fields."""

    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}')
    guided_json: dict[str, Any] | str | None = Field(
        None, description="vLLM: the output is JSON valid against this schema (an object, or its JSON text).")
    guided_choice: list[str] | None = Field(None, description="vLLM: the output is exactly one of these strings.")
    guided_regex: str | None = Field(None, max_length=10_000, description="vLLM: the output matches this regex.")
