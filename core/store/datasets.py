"""Data access for datasets."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session, defer

from core.errors import Conflict
from core.rows import ACTIVE, Dataset, Job
from core.store.owned import get_owned
from core.store.paging import before_cursor, next_in_order
from core.store.sweeps import running_sweep_using


def add_dataset(session: Session, *, dataset: Dataset) -> Dataset:
    """Insert a dataset row (the caller commits)."""
    session.add(dataset)
    session.flush()
    return dataset


def get_dataset(session: Session, *, dataset_id: str, tenant: str | None = None,
                field: str | None = None, for_update: bool = False) -> Dataset:
    """Fetch a dataset visible to `tenant` (None: any) or raise NotFound, as if other tenants' did not exist."""
    return get_owned(session, Dataset, dataset_id, what="dataset", tenant=tenant, for_update=for_update, field=field)


def list_datasets(session: Session, *, limit: int, tenant: str | None = None,
                  after: tuple[str, str] | None = None) -> list[Dataset]:
    """Newest first, without the column stats; `after` is the (created_at iso, id) of the previous page's last."""
    query = (select(Dataset).options(defer(Dataset.column_stats, raiseload=True))
             .order_by(Dataset.created_at.desc(), Dataset.id.desc()).limit(limit))
    if tenant is not None:
        query = query.where(Dataset.tenant_id == tenant)
    if after is not None:
        query = query.where(before_cursor(Dataset, after))
    return list(session.scalars(query))


def list_files(session: Session, *, limit: int, tenant: str | None, purpose: str | None = None,
               after: tuple[str, str] | None = None, ascending: bool = False) -> list[Dataset]:
    """Datasets as /v1/files lists them: by (created_at, id), optionally of one purpose (a dataset uploaded through
    /datasets, purpose None, is a fine-tune file)."""
    order = (Dataset.created_at.asc(), Dataset.id.asc()) if ascending else (Dataset.created_at.desc(),
                                                                          Dataset.id.desc())
    query = select(Dataset).options(defer(Dataset.column_stats, raiseload=True)).order_by(*order).limit(limit)
    if tenant is not None:
        query = query.where(Dataset.tenant_id == tenant)
    if purpose == "fine-tune":
        query = query.where((Dataset.purpose == purpose) | Dataset.purpose.is_(None))
    elif purpose is not None:
        query = query.where(Dataset.purpose == purpose)
    if after is not None:
        query = query.where(next_in_order(Dataset, after, ascending=ascending))
    return list(session.scalars(query))


def delete_dataset(session: Session, *, dataset_id: str, tenant: str | None = None) -> Dataset:
    """Delete a dataset row unless an unfinished job still needs it."""
    # The row lock orders this against a job insert (whose foreign-key check share-locks the row): either the
    # job commits first and is seen as busy below, or the insert waits and then fails on the foreign key.
    dataset = get_dataset(session, dataset_id=dataset_id, tenant=tenant, for_update=True)
    busy = session.scalar(
        select(Job.id).where(
            (Job.train_dataset_id == dataset_id) | (Job.eval_dataset_id == dataset_id),
            Job.status.in_(sorted(ACTIVE)),
        ).limit(1)
    )
    if busy is not None:
        raise Conflict(f"dataset {dataset_id!r} is used by unfinished job {busy!r}")
    sweep = running_sweep_using(session, dataset_id=dataset_id)
    if sweep is not None:
        raise Conflict(f"dataset {dataset_id!r} is used by running sweep {sweep!r}")
    session.delete(dataset)
    session.flush()
    return dataset
