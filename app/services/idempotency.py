"""Idempotency-Key handling for POSTs: a retry with the same key and body gets the first result."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from sqlalchemy.orm import Session

from core.auth import Principal
from core.errors import Conflict, ValidationFailed
from core.protocol import ErrorCode
from core.store import idempotency as store

KEY_RE = re.compile(r"^[\x21-\x7e]{1,255}$")


def check_key(key: str | None) -> str | None:
    """Validate the header value: 1-255 visible ASCII characters."""
    if key is not None and not KEY_RE.match(key):
        raise ValidationFailed("Idempotency-Key", "must be 1-255 visible ASCII characters")
    return key


def fingerprint(payload: Any) -> str:
    """A stable hash of a request body (JSON-able) or of raw bytes."""
    raw = payload if isinstance(payload, bytes) else json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(raw).hexdigest()


def replayed_id(session: Session, principal: Principal, *, route: str, key: str | None,
                request_hash: str) -> str | None:
    """The id created by an earlier request with this key, or None; 409 if the key came with another body."""
    if key is None:
        return None
    record = store.find_record(session, tenant_id=principal.tenant_id, route=route, key=key)
    if record is None:
        return None
    if record.request_hash != request_hash:
        raise Conflict("Idempotency-Key was already used with a different request body", field="Idempotency-Key",
                       code=ErrorCode.IDEMPOTENCY_KEY_REUSED)
    return record.resource_id


def remember(session: Session, principal: Principal, *, route: str, key: str | None, request_hash: str,
             resource_id: str) -> None:
    """Record the key with the new resource, inside the caller's transaction."""
    if key is not None:
        store.add_record(session, tenant_id=principal.tenant_id, route=route, key=key, request_hash=request_hash,
                         resource_id=resource_id)
