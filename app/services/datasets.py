"""Dataset uploads: spool to disk, validate every row while streaming, then store the file, then the row."""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Generator
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO, cast

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.schemas.datasets import DatasetPreview, DatasetRead, DatasetSummary
from app.services import idempotency
from core.auth import Principal
from core.batch_data import summarize_batch
from core.chat_data import open_rows, summarize_upload
from core.db import release
from core.errors import PayloadTooLarge, ValidationFailed
from core.evals import summarize_eval_items
from core.paths import dataset_key
from core.rows import Dataset, new_id, utcnow
from core.settings import Settings
from core.storage import ArtifactStore
from core.store import datasets as store
from core.store.paging import decode_cursor, split_page
from core.tabular import bounded_stats, format_for

log = logging.getLogger(__name__)
NAME_RE = re.compile(r"^[\w .,()+-]{1,200}$")
CHUNK = 1024 * 1024
ROUTE = "POST /datasets"


def spool_limited(stream: BinaryIO, target: Path, limit: int) -> tuple[str, int]:
    """Copy an upload to `target` in chunks, refusing it as soon as it passes the size limit; (sha256, size)."""
    digest = hashlib.sha256()
    size = 0
    with open(target, "wb") as out:
        while chunk := stream.read(CHUNK):
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"file is larger than the {limit} byte limit", field="file")
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest(), size


def create_dataset(session: Session, settings: Settings, storage: ArtifactStore, principal: Principal, *,
                   filename: str, stream: BinaryIO, name: str | None, idempotency_key: str | None = None,
                   purpose: str | None = None, route: str = ROUTE) -> Dataset:
    """Spool an upload to disk, parse and validate it row by row, then store it under a server-chosen key
    and commit the row. `purpose` (/v1/files): "batch" files are checked as batch requests, not training data."""
    filename = Path(filename or "").name  # never trust a client path
    if not filename:
        raise ValidationFailed("file", "the upload has no file name; the extension selects the format")
    if len(filename) > 255:
        raise ValidationFailed("file", "the file name is longer than 255 characters")
    fmt = format_for(filename)
    if name is not None and not NAME_RE.match(name):
        raise ValidationFailed("name", "use 1-200 letters, digits, spaces and . , ( ) + - _")
    dataset_id = new_id("ds")
    # Server-chosen name; the (validated) extension is kept because readers pick the format by it.
    key = dataset_key(f"{dataset_id}{Path(filename).suffix.lower()}")
    part = storage.work_path(key).with_suffix(".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    try:
        sha256, size = spool_limited(stream, part, settings.max_upload_bytes)
        request_hash = idempotency.fingerprint("\0".join((sha256, filename, name or "", purpose or "")))
        replayed = idempotency.replayed_id(session, principal, route=route, key=idempotency_key,
                                           request_hash=request_hash)
        if replayed is not None:
            part.unlink(missing_ok=True)
            return store.get_dataset(session, dataset_id=replayed)
        release(session)  # parsing can take a while and storing may be an upload: no connection held meanwhile
        # A JSON Lines file of conversations, preference pairs or prompt/completion pairs is a chat dataset.
        if purpose == "batch":
            summary = summarize_batch(part, fmt, max_rows=settings.max_dataset_rows)
        elif purpose == "evals":
            summary = summarize_eval_items(part, fmt, max_rows=settings.max_dataset_rows)
        else:
            summary = summarize_upload(part, fmt, max_rows=settings.max_dataset_rows,
                                       max_columns=settings.max_dataset_columns)
        storage.move_in(part, key)  # a rename, or an upload: readers never see a half-written file
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    dataset = Dataset(
        id=dataset_id, tenant_id=principal.tenant_id, name=name or filename, filename=filename, format=summary.format,
        rows=summary.rows, columns=summary.columns, column_stats=summary.stats, sha256=sha256,
        size_bytes=size, path=key, created_at=utcnow(), purpose=purpose,
    )
    try:
        store.add_dataset(session, dataset=dataset)
        idempotency.remember(session, principal, route=route, key=idempotency_key, request_hash=request_hash,
                             resource_id=dataset_id)
        session.commit()
    except IntegrityError:
        # A concurrent request with the same Idempotency-Key won the race: answer with its dataset.
        session.rollback()
        _discard(storage, key)
        replayed = idempotency.replayed_id(session, principal, route=route, key=idempotency_key,
                                           request_hash=request_hash)
        if replayed is None:
            raise
        return store.get_dataset(session, dataset_id=replayed)
    except BaseException:
        session.rollback()
        _discard(storage, key)
        raise
    return dataset


def get_dataset(session: Session, principal: Principal, *, dataset_id: str) -> Dataset:
    """One dataset by id."""
    return store.get_dataset(session, dataset_id=dataset_id, tenant=principal.scope)


def dataset_read(settings: Settings, dataset: Dataset) -> DatasetRead:
    """The public dataset object; its column stats are bounded whatever the row holds (older rows too)."""
    summary = DatasetSummary.model_validate(dataset)
    stats: dict[str, Any] = bounded_stats(dataset.column_stats or {}, dataset.columns, settings.max_dataset_columns)
    return DatasetRead(**summary.model_dump(), column_stats=stats)


def list_datasets(session: Session, principal: Principal, *, limit: int, cursor: str | None
                  ) -> tuple[list[Dataset], str | None]:
    """A page of datasets (column stats not loaded) and the cursor of the next one."""
    after = decode_cursor(cursor) if cursor else None
    return split_page(store.list_datasets(session, limit=limit + 1, tenant=principal.scope, after=after), limit)


def delete_dataset(session: Session, storage: ArtifactStore, principal: Principal, *, dataset_id: str) -> None:
    """Delete the row, commit, then remove the stored file."""
    dataset = store.delete_dataset(session, dataset_id=dataset_id, tenant=principal.scope)
    session.commit()
    _discard(storage, dataset.path)


def _discard(storage: ArtifactStore, key: str) -> None:
    """Remove a stored file nothing refers to any more; a store that fails here leaves an orphan, not an error."""
    try:
        storage.delete(key)
    except Exception:  # noqa: BLE001 - the row is already gone or never was; the client's answer stands
        log.warning("could not delete %s from %s; it is left behind", key, storage.url, exc_info=True)


PREVIEW_CELL_CHARS = 500  # a preview shows the start of long texts


def preview_dataset(session: Session, storage: ArtifactStore, principal: Principal, *, dataset_id: str,
                    rows: int) -> DatasetPreview:
    """The first `rows` rows of a stored dataset, long cells cut short; reads only as far as it shows."""
    dataset = store.get_dataset(session, dataset_id=dataset_id, tenant=principal.scope)
    release(session)  # the store may be remote: no connection held while it answers
    shown: list[dict[str, Any]] = []
    with storage.open(dataset.path) as stream:
        reader = cast(Generator[dict[str, Any], None, None], iter(open_rows(cast(BinaryIO, stream), dataset.format)))
        try:
            for row in islice(reader, rows):
                shown.append({k: v[:PREVIEW_CELL_CHARS] if isinstance(v, str) else v for k, v in row.items()})
        finally:
            reader.close()  # detaches its text wrapper while the file is still open
    return DatasetPreview(id=dataset.id, columns=dataset.columns, rows=shown, total_rows=dataset.rows)
