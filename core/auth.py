"""API keys: random bearer tokens stored as SHA-256 hashes, each belonging to a tenant."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.errors import DomainError, NotFound
from core.models import ApiKey, new_id, utcnow

KEY_PREFIX = "ts_"


class Unauthorized(DomainError):
    """Missing, malformed, unknown or revoked API key."""

    code = "unauthorized"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key and the tenant whose rows it may see (admins see every tenant)."""

    key_id: str
    tenant_id: str
    is_admin: bool

    @property
    def scope(self) -> str | None:
        """The tenant filter for data access; None (no filter) for admin keys."""
        return None if self.is_admin else self.tenant_id


def hash_key(raw: str) -> str:
    """Keys are 256 random bits, so a plain SHA-256 is enough (no slow KDF needed)."""
    return hashlib.sha256(raw.encode()).hexdigest()


def create_key(session: Session, *, name: str, tenant_id: str | None = None, is_admin: bool = False
               ) -> tuple[ApiKey, str]:
    """Store a new key and return the row plus the raw key, which is never stored or shown again."""
    raw = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(id=new_id("key"), name=name, tenant_id=tenant_id or new_id("tenant"), key_hash=hash_key(raw),
                 prefix=raw[:10], is_admin=is_admin, created_at=utcnow())
    session.add(row)
    session.flush()
    return row, raw


def revoke_key(session: Session, *, key_id: str) -> ApiKey:
    """Mark a key revoked; it stops working at once."""
    row = session.get(ApiKey, key_id)
    if row is None:
        raise NotFound(f"key {key_id!r} not found")
    row.revoked_at = row.revoked_at or utcnow()
    session.flush()
    return row


def list_keys(session: Session) -> list[ApiKey]:
    """Every key, oldest first (hashes only)."""
    return list(session.scalars(select(ApiKey).order_by(ApiKey.created_at)))


def authenticate(session: Session, *, authorization: str | None) -> Principal:
    """Resolve an `Authorization: Bearer <key>` header to a principal, or raise Unauthorized."""
    if not authorization:
        raise Unauthorized("missing Authorization header; send 'Authorization: Bearer <key>'", field="authorization")
    scheme, _, raw = authorization.partition(" ")
    if scheme.lower() != "bearer" or not raw.strip():
        raise Unauthorized("Authorization must be 'Bearer <key>'", field="authorization")
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(raw.strip())))
    if row is None or row.revoked_at is not None:
        raise Unauthorized("invalid or revoked API key", field="authorization")
    return Principal(key_id=row.id, tenant_id=row.tenant_id, is_admin=row.is_admin)
