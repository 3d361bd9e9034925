"""Webhook schemas: registering an endpoint, reading it, and its delivery log."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.rows import WebhookEventType


class WebhookCreate(BaseModel):
    """An endpoint to notify; events are signed per Standard Webhooks with the secret returned once."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=8, max_length=2000, description="http(s) URL that resolves to public addresses.")
    event_types: list[WebhookEventType] = Field(min_length=1, max_length=len(WebhookEventType),
                                                description="Which events to send.")
    description: str = Field("", max_length=200)

    @field_validator("url", "description")
    @classmethod
    def _printable(cls, value: str) -> str:
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError("control characters are not allowed")
        return value


class RotateSecret(BaseModel):
    """How long the old secret keeps signing next to the new one (default TRAINSERVE_WEBHOOK_SECRET_GRACE_S)."""

    model_config = ConfigDict(extra="forbid")

    grace_seconds: float | None = Field(None, ge=0, le=7 * 24 * 3600)


class WebhookRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    description: str
    event_types: list[str]
    created_at: datetime
    previous_secret_until: datetime | None = Field(
        description="Until then deliveries also carry a signature made with the secret before the last rotation.")
    secret: str | None = Field(None, description="whsec_...: only in the answer to create and rotate-secret.")


class AttemptRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    attempted_at: datetime
    duration_ms: float
    status_code: int | None
    response_body: str | None = Field(description="The response's first 1000 characters.")
    error: str | None = Field(description="Why no response came (refused, timed out, address not allowed).")


class DeliveryRead(BaseModel):
    id: int
    event_id: str = Field(description="The webhook-id header: the same on every redelivery.")
    event_type: str
    status: str = Field(description="pending (will retry), delivered, or failed (retries exhausted).")
    attempts: int
    next_attempt_at: datetime | None
    created_at: datetime
    finished_at: datetime | None
    attempt_log: list[AttemptRead]


class DeliveryPage(BaseModel):
    data: list[DeliveryRead]
    next_before: int | None = Field(description="Pass as ?before= for older deliveries.")
