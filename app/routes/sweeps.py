"""Sweep routes: create, list, read, cancel."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from app.deps import IdempotencyKeyDep, PrincipalDep, QueueDep, SessionDep, SettingsDep
from app.errors import ERROR_RESPONSES
from app.schemas.common import Page
from app.schemas.sweeps import SweepCreate, SweepRead
from app.services import sweeps as service

router = APIRouter(prefix="/sweeps", tags=["sweeps"], responses=ERROR_RESPONSES)


@router.post("", status_code=201, response_model=SweepRead)
def create_sweep(spec: SweepCreate, session: SessionDep, settings: SettingsDep, queue: QueueDep,
                 principal: PrincipalDep, idempotency_key: IdempotencyKeyDep) -> SweepRead:
    """Start a hyperparameter sweep; its first `parallelism` children are queued at once. A retry with the same
    Idempotency-Key and body returns the first sweep."""
    sweep = service.create_sweep(session, settings, queue, principal, spec=spec, idempotency_key=idempotency_key)
    return service.sweep_read(sweep, service.sweep_waiting(session, settings, sweep))


@router.get("", response_model=Page[SweepRead])
def list_sweeps(session: SessionDep, settings: SettingsDep, principal: PrincipalDep,
                limit: Annotated[int, Query(ge=1, le=50)] = 20,
                cursor: Annotated[str | None, Query(max_length=200)] = None) -> Page[SweepRead]:
    """Sweeps, newest first."""
    rows, next_cursor = service.list_sweeps(session, principal, limit=limit, cursor=cursor)
    data = [service.sweep_read(r, service.sweep_waiting(session, settings, r)) for r in rows]
    return Page[SweepRead](data=data, has_more=next_cursor is not None, next_cursor=next_cursor)


@router.get("/{sweep_id}", response_model=SweepRead)
def get_sweep(sweep_id: str, session: SessionDep, settings: SettingsDep, principal: PrincipalDep) -> SweepRead:
    """Every trial's settings, status and best metric, the best child, and why it waits (if it does)."""
    sweep = service.get_sweep(session, principal, sweep_id=sweep_id)
    return service.sweep_read(sweep, service.sweep_waiting(session, settings, sweep))


@router.post("/{sweep_id}/cancel", response_model=SweepRead)
def cancel_sweep(sweep_id: str, session: SessionDep, queue: QueueDep, principal: PrincipalDep) -> SweepRead:
    """Stop creating children; queued children end at once, running ones after their current step."""
    return service.sweep_read(service.cancel_sweep(session, queue, principal, sweep_id=sweep_id))
