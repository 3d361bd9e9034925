"""OpenAI's batches: the lifecycle, the plan a worker runs, where its results are kept, and the row's moves.

    validating -> in_progress    every line was checked (a bad body becomes an error line, not a failed batch)
    validating -> failed         the input file cannot be run at all (e.g. it is empty)
    in_progress -> finalizing    every line has a result; the output and error files are being written
    in_progress | finalizing -> cancelling -> cancelled   (after the chunk that is running; done lines are kept)
    in_progress -> expired       the completion window ended first (done lines are kept)
    finalizing -> completed
Progress is durable in the artifact store: each chunk of results is one part object written whole
(`part_key(batch, first_line)`), then `lines_done` is committed. A redelivered task reads the parts that
exist and goes on from the first line without one, so a finished line is never run twice.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, Field
from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from core.errors import BrokerUnavailable
from core.generation_limits import GENERATE
from core.logs import task_headers
from core.protocol import ChatMessage, ChatOptions, SamplingParams
from core.queue import TaskQueue
from core.rows import Batch, utcnow
from core.store.owned import get_owned
from core.store.paging import newest_first
from core.tasks import QUEUE_GENERATE, TASK_BATCH

VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED = "validating", "in_progress", "finalizing", "completed"
FAILED, EXPIRED, CANCELLING, CANCELLED = "failed", "expired", "cancelling", "cancelled"
MOVES: dict[str, frozenset[str]] = {
    VALIDATING: frozenset({IN_PROGRESS, FAILED, CANCELLING}),
    IN_PROGRESS: frozenset({FINALIZING, CANCELLING, EXPIRED, FAILED}),
    FINALIZING: frozenset({COMPLETED, CANCELLING, FAILED}),
    CANCELLING: frozenset({CANCELLED}),
    COMPLETED: frozenset(), FAILED: frozenset(), EXPIRED: frozenset(), CANCELLED: frozenset(),
}
RUNNABLE = frozenset({IN_PROGRESS, FINALIZING, CANCELLING})  # statuses a (redelivered) task still has work in
WINDOW = timedelta(hours=24)
OUTPUT_PURPOSE = "batch_output"


class LineError(BaseModel):
    """Why one line could not run: the error the interactive route would have answered with."""

    status_code: int
    code: str
    message: str
    param: str | None = None


class PlannedLine(BaseModel):
    """One input line as the API checked it: what to run, or the error it already has."""

    custom_id: str
    url: str
    model: str | None = None  # as the line named it (echoed in the response body)
    path: str | None = None  # where the worker loads it from (core.served_models.ServedModel.path)
    adapter: str | None = None  # a LoRA adapter job served over `path` (core.served_models.ServedModel.adapter)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    chat: ChatOptions | None = None  # a chat line's tools and template arguments
    params: SamplingParams | None = None
    tokens_field: str = GENERATE.name  # the line's field that set params.max_new_tokens: errors name it
    texts: list[str] | None = None  # /v1/embeddings: the inputs as text, or as token ids (one of the two)
    token_ids: list[list[int]] | None = None
    dimensions: int | None = None
    encoding_format: Literal["float", "base64"] = "float"
    error: LineError | None = None


class LineResult(BaseModel):
    """One line's outcome as a part stores it: OpenAI's output line, and whether it goes to the error file."""

    failed: bool
    line: dict[str, Any]


class Part(BaseModel):
    results: list[LineResult] = Field(default_factory=list)


def plan_key(batch_id: str) -> str:
    return f"batches/{batch_id}/plan.jsonl"


def part_key(batch_id: str, first: int) -> str:
    return f"batches/{batch_id}/part-{first:09d}.json"


def result_key(batch_id: str, kind: Literal["output", "errors"]) -> str:
    return f"batches/{batch_id}/{kind}.jsonl"


def get_batch(session: Session, *, batch_id: str, tenant: str | None, for_update: bool = False) -> Batch:
    """One batch visible to `tenant` (None: any), or NotFound."""
    return get_owned(session, Batch, batch_id, what="batch", tenant=tenant, for_update=for_update)


def list_batches(session: Session, *, tenant: str | None, limit: int, after: tuple[str, str] | None
                 ) -> list[Batch]:
    """Newest first, of `tenant` (None: every tenant's); `after` is the (created_at iso, id) of the previous page's
    last."""
    return list(session.scalars(newest_first(Batch, tenant=tenant, limit=limit, after=after)))


def move(session: Session, batch_id: str, target: str, **values: Any) -> bool:
    """Move a batch to `target` from any status the table allows, with its timestamp; False if it was elsewhere."""
    origins = [status for status, targets in MOVES.items() if target in targets]
    result = session.execute(update(Batch).where(Batch.id == batch_id, Batch.status.in_(origins))
                             .values(status=target, **{f"{target}_at": utcnow()}, **values))
    return bool(result.rowcount)  # type: ignore[attr-defined]


def send_batch(session: Session, queue: TaskQueue, batch_id: str) -> None:
    """Send a committed batch's task; if the broker refuses, the batch fails saying why (BrokerUnavailable)."""
    try:
        queue.send(TASK_BATCH, [batch_id], queue=QUEUE_GENERATE, headers=task_headers())
    except Exception as exc:  # noqa: BLE001 - the broker refused: the batch cannot start, and says why
        move(session, batch_id, FAILED, errors=[{"code": "broker_unavailable", "message": str(exc)[:500]}])
        session.commit()
        raise BrokerUnavailable(f"broker unavailable: {type(exc).__name__}") from exc


def record_progress(session: Session, batch_id: str, *, lines_done: int, completed: int, failed: int) -> None:
    """Commit the counts after a part is stored (never backwards: a slower duplicate cannot undo progress)."""
    session.execute(update(Batch).where(Batch.id == batch_id, Batch.lines_done <= lines_done)
                    .values(lines_done=lines_done, completed=completed, failed=failed))


def beat(session: Session, batch_id: str) -> None:
    """The batch's runner is alive."""
    session.execute(update(Batch).where(Batch.id == batch_id).values(heartbeat_at=utcnow()))


def stale_ids(session: Session, *, before: datetime) -> list[str]:
    """Unfinished batches no runner has beaten the heartbeat of since `before` (nor started since then)."""
    return list(session.scalars(select(Batch.id).where(Batch.status.in_(RUNNABLE), _silent(before))))


def claim_stale(session: Session, batch_id: str, *, before: datetime) -> bool:
    """Take a stale batch to hand on (one reaper wins: the heartbeat moves with the claim)."""
    result = session.execute(update(Batch).where(Batch.id == batch_id, Batch.status.in_(RUNNABLE), _silent(before))
                             .values(heartbeat_at=utcnow()))
    return bool(result.rowcount)  # type: ignore[attr-defined]


def _silent(before: datetime) -> Any:
    return or_(Batch.heartbeat_at < before, Batch.heartbeat_at.is_(None) & (Batch.created_at < before))
