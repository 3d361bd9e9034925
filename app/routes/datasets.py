"""Dataset routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Query, UploadFile
from starlette.concurrency import run_in_threadpool

from app.deps import IdempotencyKeyDep, PrincipalDep, SessionDep, SettingsDep, StorageDep
from app.errors import ERROR_RESPONSES
from app.schemas.common import Page
from app.schemas.datasets import DatasetRead, DatasetSummary
from app.services import datasets as service

router = APIRouter(prefix="/datasets", tags=["datasets"], responses=ERROR_RESPONSES)


@router.post("", status_code=201, response_model=DatasetRead)
async def create_dataset(session: SessionDep, settings: SettingsDep, storage: StorageDep, principal: PrincipalDep,
                         idempotency_key: IdempotencyKeyDep,
                         file: Annotated[UploadFile, File(description="CSV, TSV, JSONL or TXT, by extension.")],
                         name: Annotated[str | None, Form(max_length=200)] = None) -> DatasetRead:
    """Upload a dataset; it is parsed and validated row by row before anything is stored."""
    dataset = await run_in_threadpool(service.create_dataset, session, settings, storage, principal,
                                      filename=file.filename or "", stream=file.file, name=name,
                                      idempotency_key=idempotency_key)
    return service.dataset_read(settings, dataset)


@router.get("", response_model=Page[DatasetSummary])
def list_datasets(session: SessionDep, principal: PrincipalDep, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                  cursor: Annotated[str | None, Query(max_length=200)] = None) -> Page[DatasetSummary]:
    """Dataset summaries (no column stats), newest first."""
    rows, next_cursor = service.list_datasets(session, principal, limit=limit, cursor=cursor)
    return Page[DatasetSummary](data=[DatasetSummary.model_validate(r) for r in rows],
                                has_more=next_cursor is not None, next_cursor=next_cursor)


@router.get("/{dataset_id}", response_model=DatasetRead)
def get_dataset(session: SessionDep, settings: SettingsDep, principal: PrincipalDep, dataset_id: str) -> DatasetRead:
    """One dataset, with bounded per-column stats."""
    return service.dataset_read(settings, service.get_dataset(session, principal, dataset_id=dataset_id))


@router.delete("/{dataset_id}", status_code=204)
def delete_dataset(session: SessionDep, storage: StorageDep, principal: PrincipalDep, dataset_id: str) -> None:
    """Delete a dataset that no unfinished job needs."""
    service.delete_dataset(session, storage, principal, dataset_id=dataset_id)
