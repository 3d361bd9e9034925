"""Data access for stored /v1/responses answers: keep one, find a tenant's unexpired one, delete one."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete
from sqlalchemy.orm import Session

from core.errors import NotFound
from core.rows import StoredResponse, utcnow
from core.store.owned import get_owned


def keep_response(session: Session, *, response_id: str, tenant: str, model: str, previous_response_id: str | None,
                  context: list[dict[str, Any]], input_items: list[dict[str, Any]], body: dict[str, Any],
                  retention_s: float, now: datetime | None = None) -> StoredResponse:
    """Store a response until `retention_s` from now; the tenant's expired ones go at the same time."""
    now = now or utcnow()
    session.execute(delete(StoredResponse).where(StoredResponse.tenant_id == tenant,
                                                 StoredResponse.expires_at <= now))
    row = StoredResponse(id=response_id, tenant_id=tenant, model=model, previous_response_id=previous_response_id,
                         context=context, input_items=input_items, body=body, created_at=now,
                         expires_at=now + timedelta(seconds=retention_s))
    session.add(row)
    return row


def find_response(session: Session, *, response_id: str, tenant: str | None, field: str | None = None,
                  now: datetime | None = None) -> StoredResponse:
    """The tenant's stored response `response_id`; NotFound naming `field` when it is missing, expired (the same
    answer as missing) or another tenant's."""
    row = get_owned(session, StoredResponse, response_id, what="response", tenant=tenant, field=field)
    if row.expires_at <= (now or utcnow()):
        raise NotFound(f"response {response_id!r} not found", field=field)
    return row


def delete_response(session: Session, *, response_id: str, tenant: str | None) -> None:
    """Delete the tenant's stored response (NotFound as find_response)."""
    session.delete(find_response(session, response_id=response_id, tenant=tenant))
