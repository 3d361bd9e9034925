"""Data access for sweeps."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.rows import Sweep, SweepStatus
from core.store.owned import get_owned
from core.store.paging import newest_first


def get_sweep(session: Session, *, sweep_id: str, tenant: str | None = None, for_update: bool = False) -> Sweep:
    """Fetch a sweep visible to `tenant` (None: any) or raise NotFound."""
    return get_owned(session, Sweep, sweep_id, what="sweep", tenant=tenant, for_update=for_update)


def list_sweeps(session: Session, *, limit: int, tenant: str | None = None,
                after: tuple[str, str] | None = None) -> list[Sweep]:
    """Newest first."""
    return list(session.scalars(newest_first(Sweep, tenant=tenant, limit=limit, after=after)))


def running_sweep_using(session: Session, *, dataset_id: str) -> str | None:
    """A running sweep whose future children will train or evaluate on `dataset_id`, or None."""
    for sweep in session.scalars(select(Sweep).where(Sweep.status == SweepStatus.RUNNING)):
        if dataset_id in (sweep.template.get("train_dataset_id"), sweep.template.get("eval_dataset_id")):
            return sweep.id
    return None
