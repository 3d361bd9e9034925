"""Idempotency records: the first result of a keyed POST, per tenant and route."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.rows import IdempotencyRecord, utcnow


def find_record(session: Session, *, tenant_id: str, route: str, key: str) -> IdempotencyRecord | None:
    """The record stored for this key, if any."""
    query = select(IdempotencyRecord).where(IdempotencyRecord.tenant_id == tenant_id,
                                            IdempotencyRecord.route == route, IdempotencyRecord.key == key)
    return session.scalars(query).first()


def add_record(session: Session, *, tenant_id: str, route: str, key: str, request_hash: str,
               resource_id: str) -> None:
    """Store the key in the same transaction as the resource it created (unique per tenant/route/key)."""
    session.add(IdempotencyRecord(tenant_id=tenant_id, route=route, key=key, request_hash=request_hash,
                                  resource_id=resource_id, created_at=utcnow()))
    session.flush()
