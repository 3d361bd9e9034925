"""API keys: random bearer tokens stored as SHA-256 hashes, each belonging to a tenant."""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.errors import DomainError, NotFound
from core.rows import ApiKey, new_id, utcnow
from core.protocol import ErrorCode

KEY_PREFIX = "ts_"
# The shape of a raw key: the prefix and 43 URL-safe base64 characters (32 random bytes); a little slack
# so a truncated or hand-pasted key is still recognised.
KEY_SHAPE = re.compile(re.escape(KEY_PREFIX) + r"[A-Za-z0-9_-]{32,}")
# Query parameters clients (and other APIs' conventions) use for credentials.
CREDENTIAL_PARAMS = frozenset({"api_key", "apikey", "api-key", "key", "access_token", "token", "auth", "authorization"})
REDACTED = "REDACTED"


class Unauthorized(DomainError):
    """Missing, malformed, unknown or revoked API key."""

    code = ErrorCode.UNAUTHORIZED


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


def query_credential(params: Iterable[tuple[str, str]]) -> str | None:
    """The name of the first query parameter that carries (or is named like) a credential, else None."""
    for name, value in params:
        if name.lower() in CREDENTIAL_PARAMS or KEY_SHAPE.search(value) or KEY_SHAPE.search(name):
            return name
    return None


def refuse_query_credentials(params: Iterable[tuple[str, str]]) -> None:
    """Raise Unauthorized naming the parameter when a credential is sent in the query string (it would be logged)."""
    name = query_credential(params)
    if name is not None:
        raise Unauthorized("API keys are accepted only in the 'Authorization: Bearer <key>' header, never in the "
                           "query string (URLs end up in logs and browser history); revoke a key sent this way",
                           field=name[:64], code=ErrorCode.KEY_IN_QUERY)


def redact_query(target: str) -> str:
    """`target` (a path and optional query string) with every key-shaped string and credential parameter replaced."""
    path, sep, query = target.partition("?")
    path = KEY_SHAPE.sub(REDACTED, path)
    if not sep:
        return path
    pairs = parse_qsl(query, keep_blank_values=True)
    if query_credential(pairs) is None and not KEY_SHAPE.search(query):
        return f"{path}?{query}"
    cleaned = [(REDACTED if KEY_SHAPE.search(name) else name,
                REDACTED if query_credential([(name, value)]) else value) for name, value in pairs]
    if not cleaned:  # not a parseable query, yet it holds a key: drop it whole
        return f"{path}?{REDACTED}"
    return f"{path}?{urlencode(cleaned)}"


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
