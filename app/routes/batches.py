"""OpenAI's /v1/batches: create, list, retrieve, cancel (results come as /v1/files of purpose batch_output)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query
from starlette.concurrency import run_in_threadpool

from app.deps import PrincipalDep, QueueDep, SessionDep, SettingsDep, StorageDep
from app.errors import ERROR_RESPONSES
from app.schemas.batches import Batch, BatchCreate, BatchList
from app.services import batches as service

router = APIRouter(prefix="/v1/batches", tags=["openai"], responses=ERROR_RESPONSES)


@router.post("", response_model=Batch)
async def create_batch(body: Annotated[BatchCreate, Body()], session: SessionDep, settings: SettingsDep,
                       storage: StorageDep, queue: QueueDep, principal: PrincipalDep) -> Batch:
    """Check every line of the input file (a bad body is an error line, not a failed batch), then run it."""
    row = await run_in_threadpool(service.create_batch, session, settings, storage, queue, principal, body=body)
    return service.batch_object(row)


@router.get("", response_model=BatchList)
def list_batches(session: SessionDep, principal: PrincipalDep,
                 after: Annotated[str | None, Query(max_length=40, description="The last id of the previous page.")]
                 = None, limit: Annotated[int, Query(ge=1, le=100)] = 20) -> BatchList:
    """The caller's batches, newest first."""
    return service.list_page(session, principal, after=after, limit=limit)


@router.get("/{batch_id}", response_model=Batch)
def retrieve_batch(batch_id: str, session: SessionDep, principal: PrincipalDep) -> Batch:
    """Status, request_counts, and once it ended output_file_id and error_file_id."""
    return service.batch_object(service.retrieve(session, principal, batch_id=batch_id))


@router.post("/{batch_id}/cancel", response_model=Batch)
def cancel_batch(batch_id: str, session: SessionDep, principal: PrincipalDep) -> Batch:
    """Cancel: cancelling at once, cancelled after the chunk of lines in progress (done lines are kept)."""
    return service.batch_object(service.cancel(session, principal, batch_id=batch_id))
