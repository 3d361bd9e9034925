"""Fetch one tenant-owned row by id: the same NotFound whether it is missing, malformed or another tenant's."""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.errors import NotFound
from core.rows import is_valid_id

Row = TypeVar("Row")


def get_owned(session: Session, model: type[Row], row_id: str, *, what: str, tenant: str | None = None,
              for_update: bool = False, field: str | None = None) -> Row:
    """The `model` row `row_id` visible to `tenant` (None: any), locked when `for_update`, or NotFound naming `what`."""
    if not is_valid_id(row_id):
        raise NotFound(f"{what} {row_id!r} not found", field=field)
    table: Any = model
    query = select(table).where(table.id == row_id)
    if tenant is not None:
        query = query.where(table.tenant_id == tenant)
    if for_update:
        query = query.with_for_update()
    row = session.scalars(query).first()
    if row is None:
        raise NotFound(f"{what} {row_id!r} not found", field=field)
    return row
