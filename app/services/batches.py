"""/v1/batches: create (every line checked into a plan, then one task on the generation queue), list, retrieve,
cancel. The batch row is the truth; the worker (worker.batches.run) runs the plan and writes the result files."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

from sqlalchemy.orm import Session

from app.schemas.batches import Batch, BatchCreate, BatchError, BatchErrors, BatchList, RequestCounts
from app.services import files
from app.services.batch_plan import Planning, plan_lines
from app.services.files import unix
from core.auth import Principal
from core.batches import (
    CANCELLED,
    CANCELLING,
    IN_PROGRESS,
    MOVES,
    WINDOW,
    get_batch,
    list_batches,
    move,
    plan_key,
    send_batch,
)
from core.db import release
from core.embeddings import resolve_embedding_model
from core.errors import Conflict, StorageUnavailable, ValidationFailed
from core.pretrained import builtin_aliases
from core.queue import TaskQueue
from core.rows import Batch as BatchRow
from core.rows import new_id, utcnow
from core.served_models import ServedModel, resolve_served_model
from core.settings import Settings
from core.storage import ArtifactStore
from core.store.paging import cursor_of

MOMENTS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
           "cancelled_at")


def batch_object(row: BatchRow) -> Batch:
    """A batch row as OpenAI's batch object."""
    errors = BatchErrors(data=[BatchError(**e) for e in row.errors]) if row.errors else None
    return Batch(id=row.id, endpoint=row.endpoint, errors=errors, input_file_id=row.input_file_id,
                 completion_window=row.completion_window, status=row.status,  # type: ignore[arg-type]
                 output_file_id=row.output_file_id, error_file_id=row.error_file_id,
                 created_at=unix(row.created_at) or 0, expires_at=unix(row.expires_at),
                 **{name: unix(getattr(row, name)) for name in MOMENTS},
                 request_counts=RequestCounts(total=row.total, completed=row.completed, failed=row.failed),
                 metadata=row.metadata_)


def create_batch(session: Session, settings: Settings, storage: ArtifactStore, queue: TaskQueue,
                 principal: Principal, *, body: BatchCreate,
                 before_commit: Callable[[Session, BatchRow], None] | None = None) -> BatchRow:
    """Check every line (a bad body becomes an error line), store the plan, commit the row, enqueue its task.

    `before_commit` writes what must commit with the row (an eval run naming its batch) before the task is sent."""
    dataset = files.get_file(session, principal, file_id=body.input_file_id, field="input_file_id")
    if dataset.purpose != "batch":
        raise ValidationFailed("input_file_id", f"file {dataset.id!r} has purpose {dataset.purpose or 'fine-tune'}; "
                                                "a batch runs a file uploaded with purpose \"batch\"")
    batch_id, path = new_id("batch"), dataset.path

    @cache
    def served(name: str) -> ServedModel:
        return resolve_served_model(session, settings, name=name, tenant=principal.scope)

    @cache
    def embedding(name: str) -> str:
        return resolve_embedding_model(session, settings, name=name, tenant=principal.scope,
                                       aliases=builtin_aliases())

    release(session)  # reading and storing the plan may be slow (an object store): no connection held meanwhile
    key = plan_key(batch_id)
    part = storage.work_path(key).with_suffix(".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    total = 0
    try:
        with storage.open(path) as source, open(part, "w", encoding="utf-8") as out:
            for line in plan_lines(source, endpoint=body.endpoint,
                                   planning=Planning(served=served, embedding=embedding, settings=settings)):
                out.write(line.model_dump_json() + "\n")
                total += 1
        release(session)
        if total == 0:
            raise ValidationFailed("input_file_id", "the file holds no requests")
        storage.move_in(part, key)
    except OSError as exc:
        raise StorageUnavailable(f"the artifact store could not be used: {type(exc).__name__}") from exc
    finally:
        part.unlink(missing_ok=True)
    now = utcnow()
    row = BatchRow(id=batch_id, tenant_id=principal.tenant_id, status=IN_PROGRESS, endpoint=body.endpoint,
                   input_file_id=dataset.id, completion_window=body.completion_window, metadata_=body.metadata,
                   total=total, completed=0, failed=0, lines_done=0, created_at=now, in_progress_at=now,
                   expires_at=now + WINDOW)
    session.add(row)
    if before_commit is not None:
        session.flush()
        before_commit(session, row)
    session.commit()
    send_batch(session, queue, batch_id)
    session.refresh(row)
    return row


def retrieve(session: Session, principal: Principal, *, batch_id: str) -> BatchRow:
    """One of the caller's batches (404 otherwise)."""
    return get_batch(session, batch_id=batch_id, tenant=principal.scope)


def list_page(session: Session, principal: Principal, *, after: str | None, limit: int) -> BatchList:
    """The caller's batches newest first; `after` is the id of the previous page's last batch."""
    cursor = cursor_of(retrieve(session, principal, batch_id=after)) if after else None
    rows = list_batches(session, tenant=principal.scope, limit=limit + 1, after=cursor)
    return BatchList.of([batch_object(row) for row in rows[:limit]], has_more=len(rows) > limit)


def cancel(session: Session, principal: Principal, *, batch_id: str) -> BatchRow:
    """Ask a running batch to stop: cancelling now, cancelled once the worker ends the chunk it is on."""
    row = get_batch(session, batch_id=batch_id, tenant=principal.scope, for_update=True)
    if row.status in (CANCELLING, CANCELLED):
        return row
    if CANCELLING not in MOVES[row.status]:
        raise Conflict(f"batch {batch_id!r} is {row.status}; only a running batch can be cancelled")
    move(session, batch_id, CANCELLING)
    session.commit()
    session.refresh(row)
    return row
