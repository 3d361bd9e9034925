"""Schemas of /v1/batches (OpenAI's shapes)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.schemas.fine_tuning import OpenAIList

Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]


class BatchCreate(BaseModel):
    """OpenAI's batch body: a purpose "batch" file of requests to `endpoint`, run within 24 hours."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=40)
    endpoint: Endpoint
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = Field(None, description="Up to 16 pairs; keys up to 64, values up to 512 "
                                                              "characters.")

    @field_validator("metadata")
    @classmethod
    def _small(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError("up to 16 pairs, keys up to 64 and values up to 512 characters")
        return value


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class Batch(BaseModel):
    """A batch: its status, counts, and once it ends the files of its results (output) and failed lines (error)."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None


BatchList = OpenAIList[Batch]
