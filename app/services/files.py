"""/v1/files over the dataset store: an OpenAI file is a trainserve dataset (the same id under /datasets).

A "fine-tune" file is validated as any dataset upload (tables, and chat, preference or completion JSON Lines);
a "batch" file as batch requests (core.batch_data). A dataset uploaded through /datasets lists as a fine-tune file.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import BinaryIO

from sqlalchemy.orm import Session

from app.schemas.fine_tuning import FileDeleted, FileList, FileObject
from app.services import datasets
from core.auth import Principal
from core.db import release
from core.errors import NotFound, StorageUnavailable, ValidationFailed
from core.rows import Dataset
from core.settings import Settings
from core.storage import ArtifactStore
from core.store import datasets as store
from core.store.paging import cursor_of
from core.tabular import short

ROUTE = "POST /v1/files"
PURPOSES = ("fine-tune", "batch", "evals")  # what an upload may say
LISTED = (*PURPOSES, "batch_output")  # plus the results of /v1/batches, which the workers write
CHUNK = 256 * 1024


def unix(moment: datetime | None) -> int | None:
    """A timestamp as OpenAI's objects carry it: whole Unix seconds."""
    return None if moment is None else int(moment.timestamp())


def check_purpose(purpose: str | None, known: tuple[str, ...] = PURPOSES) -> str:
    """The upload's purpose, one trainserve stores (422 naming `purpose` otherwise)."""
    if purpose not in known:
        raise ValidationFailed("purpose", f"purpose must be one of {', '.join(known)}; got {short(purpose)}")
    return purpose


def upload_file(session: Session, settings: Settings, storage: ArtifactStore, principal: Principal, *,
                filename: str, stream: BinaryIO, purpose: str | None, idempotency_key: str | None) -> Dataset:
    """Validate the purpose, then store the upload as a dataset (validated row by row, named by line number)."""
    checked = check_purpose(purpose)
    return datasets.create_dataset(session, settings, storage, principal, filename=filename, stream=stream, name=None,
                                   idempotency_key=idempotency_key, purpose=checked, route=ROUTE)


def file_object(dataset: Dataset) -> FileObject:
    """A dataset as OpenAI's file object."""
    return FileObject(id=dataset.id, bytes=dataset.size_bytes, created_at=unix(dataset.created_at) or 0,
                      filename=dataset.filename, purpose=dataset.purpose or "fine-tune")  # type: ignore[arg-type]


def list_files(session: Session, principal: Principal, *, after: str | None, limit: int, order: str,
               purpose: str | None) -> FileList:
    """A page of files in `order` of creation; `after` is the id of the previous page's last file."""
    if purpose is not None:
        check_purpose(purpose, LISTED)
    cursor = cursor_of(get_file(session, principal, file_id=after, field="after")) if after else None
    rows = store.list_files(session, limit=limit + 1, tenant=principal.scope, purpose=purpose, after=cursor,
                            ascending=order == "asc")
    return FileList.of([file_object(row) for row in rows[:limit]], has_more=len(rows) > limit)


def get_file(session: Session, principal: Principal, *, file_id: str, field: str | None = None) -> Dataset:
    """One of the caller's files (404 for another tenant's, as for a missing one)."""
    return store.get_dataset(session, dataset_id=file_id, tenant=principal.scope, field=field)


def delete_file(session: Session, storage: ArtifactStore, principal: Principal, *, file_id: str) -> FileDeleted:
    """Delete a file no unfinished job trains on (409 otherwise)."""
    datasets.delete_dataset(session, storage, principal, dataset_id=file_id)
    return FileDeleted(id=file_id, deleted=True)


def file_content(session: Session, storage: ArtifactStore, principal: Principal, *, file_id: str
                 ) -> tuple[Dataset, Iterator[bytes]]:
    """The file and its stored bytes as chunks; no database connection is held while they stream."""
    dataset = get_file(session, principal, file_id=file_id)
    release(session)
    try:  # before the answer starts: a store that fails is still an error status
        stream = storage.open(dataset.path)
    except FileNotFoundError as exc:
        raise NotFound(f"the content of file {file_id!r} is no longer stored") from exc
    except OSError as exc:
        raise StorageUnavailable(f"the artifact store could not be read: {type(exc).__name__}") from exc

    def chunks() -> Iterator[bytes]:
        with stream:
            while chunk := stream.read(CHUNK):
                yield chunk

    return dataset, chunks()
