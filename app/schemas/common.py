"""Shared schema pieces: the error envelope and cursor pages."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from pydantic import BaseModel, Field

T = TypeVar("T")


class ErrorBody(BaseModel):
    code: str = Field(description="Stable machine-readable error code.")
    message: str = Field(description="What went wrong, for humans.")
    field: str | None = Field(None, description="The request field at fault, dotted (e.g. hyperparameters.seed).")
    details: Any = None
    param: str | None = Field(None, description="On OpenAI's /v1 routes: the field again, under OpenAI's name.")
    type: str | None = Field(None, description="On OpenAI's /v1 routes: invalid_request_error or server_error.")


class ErrorEnvelope(BaseModel):
    """Every error response has this shape."""

    error: ErrorBody


class Page(BaseModel, Generic[T]):
    """A page of results, newest first; pass next_cursor as ?cursor= for the next page."""

    data: list[T]
    has_more: bool
    next_cursor: str | None = None
