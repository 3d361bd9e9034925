"""Keyset (cursor) pagination over (created_at, id), newest first."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Select, and_, or_, select

from core.errors import ValidationFailed


def encode_cursor(created_at: datetime, row_id: str) -> str:
    """Opaque cursor for the row a page ended on."""
    raw = f"{created_at.isoformat()}|{row_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[str, str]:
    """Inverse of encode_cursor; a tampered cursor is a 422 on the `cursor` field."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        created, row_id = base64.urlsafe_b64decode(padded.encode()).decode().split("|", 1)
        datetime.fromisoformat(created)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValidationFailed("cursor", "malformed pagination cursor") from exc
    return created, row_id


def before_cursor(model: Any, after: tuple[str, str]) -> Any:
    """Rows strictly after the cursor in (created_at desc, id desc) order."""
    created = datetime.fromisoformat(after[0])
    return or_(model.created_at < created, and_(model.created_at == created, model.id < after[1]))


Row = TypeVar("Row")


def split_page(rows: Sequence[Row], limit: int) -> tuple[list[Row], str | None]:
    """Rows fetched with limit+1: the page itself and the cursor of the next page, if there is one."""
    page = list(rows[:limit])
    if len(rows) <= limit:
        return page, None
    last: Any = page[-1]
    return page, encode_cursor(last.created_at, last.id)


def next_in_order(model: Any, after: tuple[str, str], *, ascending: bool = False) -> Any:
    """Rows strictly after the cursor in (created_at, id) order, newest first unless `ascending`."""
    if not ascending:
        return before_cursor(model, after)
    created = datetime.fromisoformat(after[0])
    return or_(model.created_at > created, and_(model.created_at == created, model.id > after[1]))


def cursor_of(row: Any) -> tuple[str, str]:
    """The (created_at iso, id) cursor a row ends a page on (for APIs whose cursor is the last object's id)."""
    return row.created_at.isoformat(), row.id


def newest_first(model: Any, *, tenant: str | None, limit: int, after: tuple[str, str] | None) -> Select[Any]:
    """A page of `model` rows newest first, of `tenant` (None: every tenant's), after a (created_at iso, id) cursor."""
    query = select(model).order_by(model.created_at.desc(), model.id.desc()).limit(limit)
    if tenant is not None:
        query = query.where(model.tenant_id == tenant)
    if after is not None:
        query = query.where(before_cursor(model, after))
    return query
