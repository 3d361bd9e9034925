"""Data access for model aliases: find one by name (as the generation routes resolve model names), list, history."""

from __future__ import annotations

import re

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.errors import NotFound, ValidationFailed
from core.rows import ModelAlias, ModelAliasMove

# `family:stage`: the colon keeps alias names apart from local model names, job ids and hub ids.
ALIAS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}:[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def is_alias_name(name: str) -> bool:
    """Whether a model name is an alias's (only aliases hold a colon)."""
    return ":" in name


def find_alias(session: Session, *, name: str, tenant: str | None, for_update: bool = False,
               field: str = "model") -> ModelAlias:
    """The alias `name` of `tenant` (an admin's None: the one tenant that has it), or NotFound naming `field`."""
    query = select(ModelAlias).where(ModelAlias.name == name)
    if tenant is not None:
        query = query.where(ModelAlias.tenant_id == tenant)
    if for_update:
        query = query.with_for_update()
    rows = list(session.scalars(query.limit(2)))
    if not rows:
        raise NotFound(f"alias {name!r} not found; GET /aliases lists them", field=field)
    if len(rows) > 1:
        raise ValidationFailed(field, f"several tenants have an alias {name!r}; use a key of the tenant")
    return rows[0]


def list_aliases(session: Session, *, tenant: str | None) -> list[ModelAlias]:
    """The tenant's aliases by name."""
    query = select(ModelAlias).order_by(ModelAlias.name, ModelAlias.tenant_id)
    if tenant is not None:
        query = query.where(ModelAlias.tenant_id == tenant)
    return list(session.scalars(query))


def history(session: Session, *, alias_id: str) -> list[ModelAliasMove]:
    """An alias's moves, newest first (its creation last)."""
    return list(session.scalars(select(ModelAliasMove).where(ModelAliasMove.alias_id == alias_id)
                                .order_by(ModelAliasMove.moved_at.desc(), ModelAliasMove.id.desc())))
