"""Dataset uploads: validate everything first, then store the file, then the row."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import BinaryIO

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.services import idempotency
from core.auth import Principal
from core.errors import PayloadTooLarge, ValidationFailed
from core.models import Dataset, new_id, utcnow
from core.settings import Settings
from core.store import datasets as store
from core.store.paging import decode_cursor, split_page
from core.tabular import column_stats, format_for, parse_table

NAME_RE = re.compile(r"^[\w .,()+-]{1,200}$")
CHUNK = 1024 * 1024


def read_limited(stream: BinaryIO, limit: int) -> bytes:
    """Read an upload, refusing it as soon as it passes the size limit."""
    chunks: list[bytes] = []
    size = 0
    while chunk := stream.read(CHUNK):
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"file is larger than the {limit} byte limit", field="file")
        chunks.append(chunk)
    return b"".join(chunks)


ROUTE = "POST /datasets"


def create_dataset(session: Session, settings: Settings, principal: Principal, *, filename: str,
                   stream: BinaryIO, name: str | None, idempotency_key: str | None = None) -> Dataset:
    """Parse and validate an upload, then store the bytes under a server-chosen path and commit the row."""
    filename = Path(filename or "").name  # never trust a client path
    if not filename:
        raise ValidationFailed("file", "the upload has no file name; the extension selects the format")
    fmt = format_for(filename)
    if name is not None and not NAME_RE.match(name):
        raise ValidationFailed("name", "use 1-200 letters, digits, spaces and . , ( ) + - _")
    data = read_limited(stream, settings.max_upload_bytes)
    request_hash = idempotency.fingerprint(hashlib.sha256(data).hexdigest() + "\0" + filename + "\0" + (name or ""))
    replayed = idempotency.replayed_id(session, principal, route=ROUTE, key=idempotency_key,
                                       request_hash=request_hash)
    if replayed is not None:
        return store.get_dataset(session, dataset_id=replayed)
    table = parse_table(data, fmt, max_rows=settings.max_dataset_rows)

    dataset_id = new_id("ds")
    # Server-chosen name; the (validated) extension is kept because readers pick the format by it.
    relative = Path("datasets") / f"{dataset_id}{Path(filename).suffix.lower()}"
    target = settings.home / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    tmp.write_bytes(data)
    os.replace(tmp, target)  # readers never see a half-written file
    dataset = Dataset(
        id=dataset_id, tenant_id=principal.tenant_id, name=name or filename, filename=filename, format=fmt,
        rows=len(table.rows),
        columns=table.columns, column_stats=column_stats(table), sha256=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data), path=str(relative), created_at=utcnow(),
    )
    try:
        store.add_dataset(session, dataset=dataset)
        idempotency.remember(session, principal, route=ROUTE, key=idempotency_key, request_hash=request_hash,
                             resource_id=dataset_id)
        session.commit()
    except IntegrityError:
        # A concurrent request with the same Idempotency-Key won the race: answer with its dataset.
        session.rollback()
        target.unlink(missing_ok=True)
        replayed = idempotency.replayed_id(session, principal, route=ROUTE, key=idempotency_key,
                                           request_hash=request_hash)
        if replayed is None:
            raise
        return store.get_dataset(session, dataset_id=replayed)
    except BaseException:
        session.rollback()
        target.unlink(missing_ok=True)
        raise
    return dataset


def get_dataset(session: Session, principal: Principal, *, dataset_id: str) -> Dataset:
    """One dataset by id."""
    return store.get_dataset(session, dataset_id=dataset_id, tenant=principal.scope)


def list_datasets(session: Session, principal: Principal, *, limit: int, cursor: str | None
                  ) -> tuple[list[Dataset], str | None]:
    """A page of datasets and the cursor of the next one."""
    after = decode_cursor(cursor) if cursor else None
    return split_page(store.list_datasets(session, limit=limit + 1, tenant=principal.scope, after=after), limit)


def delete_dataset(session: Session, settings: Settings, principal: Principal, *, dataset_id: str) -> None:
    """Delete the row, commit, then remove the file."""
    dataset = store.delete_dataset(session, dataset_id=dataset_id, tenant=principal.scope)
    session.commit()
    (settings.home / dataset.path).unlink(missing_ok=True)
