"""OpenAI's /v1/files: upload, list, retrieve, content, delete (files are datasets, tenant-scoped)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from app.deps import IdempotencyKeyDep, PrincipalDep, SessionDep, SettingsDep, StorageDep
from app.errors import ERROR_RESPONSES
from app.schemas.fine_tuning import FileDeleted, FileList, FileObject
from app.services import files as service

router = APIRouter(prefix="/v1/files", tags=["openai"], responses=ERROR_RESPONSES)


@router.post("", response_model=FileObject)
async def upload_file(session: SessionDep, settings: SettingsDep, storage: StorageDep, principal: PrincipalDep,
                      idempotency_key: IdempotencyKeyDep,
                      file: Annotated[UploadFile, File(description="JSON Lines (or a table for fine-tune).")],
                      purpose: Annotated[str, Form(max_length=40, description="fine-tune or batch")]) -> FileObject:
    """Upload a fine-tune or batch file; every line is validated (a defect is named by its line number)."""
    dataset = await run_in_threadpool(service.upload_file, session, settings, storage, principal,
                                      filename=file.filename or "", stream=file.file, purpose=purpose,
                                      idempotency_key=idempotency_key)
    return service.file_object(dataset)


@router.get("", response_model=FileList)
def list_files(session: SessionDep, principal: PrincipalDep,
               after: Annotated[str | None, Query(max_length=40, description="The last id of the previous page.")]
               = None, limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
               order: Annotated[Literal["asc", "desc"], Query()] = "desc",
               purpose: Annotated[str | None, Query(max_length=40)] = None) -> FileList:
    """The caller's files (datasets uploaded through /datasets list as fine-tune files)."""
    return service.list_files(session, principal, after=after, limit=limit, order=order, purpose=purpose)


@router.get("/{file_id}", response_model=FileObject)
def retrieve_file(session: SessionDep, principal: PrincipalDep, file_id: str) -> FileObject:
    """One file."""
    return service.file_object(service.get_file(session, principal, file_id=file_id))


@router.get("/{file_id}/content", response_class=StreamingResponse,
            responses={200: {"content": {"application/octet-stream": {}}}})
def file_content(session: SessionDep, storage: StorageDep, principal: PrincipalDep, file_id: str
                 ) -> StreamingResponse:
    """The file's bytes as uploaded."""
    dataset, chunks = service.file_content(session, storage, principal, file_id=file_id)
    return StreamingResponse(chunks, media_type="application/octet-stream",
                             headers={"content-length": str(dataset.size_bytes)})


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(session: SessionDep, storage: StorageDep, principal: PrincipalDep, file_id: str) -> FileDeleted:
    """Delete a file no unfinished job needs (409 otherwise)."""
    return service.delete_file(session, storage, principal, file_id=file_id)
