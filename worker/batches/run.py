"""Run a /v1/batches batch on a generation worker: chunk by chunk, each chunk's results stored whole before
the progress is committed, so a redelivered task (a worker that died) goes on from the first line without a
result and never runs a finished line again. core.batches tells the lifecycle; worker.batches.lines runs lines.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.batches import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    EXPIRED,
    FAILED,
    FINALIZING,
    OUTPUT_PURPOSE,
    RUNNABLE,
    LineError,
    LineResult,
    Part,
    PlannedLine,
    get_batch,
    move,
    part_key,
    plan_key,
    record_progress,
    result_key,
)
from core.db import session_scope
from core.protocol import ErrorCode
from core.rows import Batch, Dataset, new_id, utcnow
from core.storage import ArtifactStore
from worker.batches.grading import grade_results
from worker.batches.leases import Lease, TenantRuns, heartbeat
from worker.batches.lines import LINE_HANDLERS, Outcome, Pacer, Share, digest, error_outcome
from worker.context import WorkerContext

log = logging.getLogger(__name__)
COLUMNS = ["id", "custom_id", "response", "error"]


def read_plan(storage: ArtifactStore, batch_id: str) -> list[PlannedLine]:
    """The batch's checked lines, in input order."""
    with storage.open(plan_key(batch_id)) as stream:
        return [PlannedLine.model_validate_json(raw) for raw in stream if raw.strip()]


def stored_parts(storage: ArtifactStore, batch_id: str, total: int) -> tuple[int, list[LineResult]]:
    """The results already stored: the first line without one, and the results before it, in order."""
    done, results = 0, []
    while done < total and storage.exists(part_key(batch_id, done)):
        with storage.open(part_key(batch_id, done)) as stream:
            part = Part.model_validate_json(stream.read())
        if not part.results:
            break
        results.extend(part.results)
        done += len(part.results)
    return done, results


def _put(storage: ArtifactStore, key: str, data: bytes) -> None:
    """Store `data` whole under `key` (a rename or one upload: a reader never sees part of it)."""
    local = storage.work_path(key).with_suffix(".part")
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_bytes(data)
    storage.move_in(local, key)


def line_result(batch_id: str, index: int, line: PlannedLine, outcome: Outcome) -> LineResult:
    """OpenAI's output line for one request (ids stable across a redelivery)."""
    rid = digest(batch_id, index)
    return LineResult(failed=outcome.status_code != 200,
                      line={"id": f"batch_req_{rid}", "custom_id": line.custom_id,
                            "response": {"status_code": outcome.status_code, "request_id": f"req_{rid}",
                                         "body": outcome.body}, "error": None})


def run_chunk(ctx: WorkerContext, batch_id: str, first: int, lines: list[PlannedLine], pacer: Pacer
              ) -> list[LineResult]:
    """Results of lines first.. in order: errors the plan found, the rest run by their endpoint's line handler."""
    outcomes: dict[int, Outcome] = {}
    by_url: dict[str, list[tuple[int, PlannedLine]]] = {}
    for index, line in enumerate(lines, start=first):
        if line.error is not None:
            outcomes[index] = error_outcome(line.error)
        elif line.url not in LINE_HANDLERS:
            outcomes[index] = error_outcome(LineError(status_code=404, code=ErrorCode.NOT_FOUND, param="url",
                                                      message=f"{line.url} is not served by this build"))
        else:
            by_url.setdefault(line.url, []).append((index, line))
    for url, todo in by_url.items():
        outcomes.update(LINE_HANDLERS[url](ctx, batch_id, todo, pacer))
    return [line_result(batch_id, index, line, outcomes[index]) for index, line in enumerate(lines, start=first)]


def run_batch(ctx: WorkerContext, batch_id: str) -> None:
    """Run (or resume) a batch to its end: completed, cancelled (after a cancel) or expired (past its window)."""
    with session_scope(ctx.sessions) as session:
        row = get_batch(session, batch_id=batch_id, tenant=None)
        status, expires_at, tenant = row.status, row.expires_at, row.tenant_id
    if status not in RUNNABLE:
        return  # a redelivery of a batch that has ended: nothing to do
    try:
        plan = read_plan(ctx.storage, batch_id)
    except OSError as exc:
        with session_scope(ctx.sessions) as session:
            move(session, batch_id, FAILED, errors=[{"code": "plan_unavailable", "message": str(exc)[:500]}])
        return
    lease = Lease(ctx, batch_id)
    if not lease.acquire():
        return  # another task runs it (a duplicate delivery); if that holder dies, the reaper sends it again
    runs = TenantRuns(ctx, tenant, batch_id)
    if not runs.acquire():  # the tenant runs its limit of batches: the reaper sends this one again later
        lease.release()
        log.info("batch %s waits: its tenant already runs %d batches", batch_id, runs.limit)
        return
    ticker = heartbeat(ctx, batch_id, lease, runs)
    ticker.start()
    try:
        _run(ctx, batch_id, plan, expires_at, tenant)
    finally:
        ticker.stop()
        runs.release()
        lease.release()


def _run(ctx: WorkerContext, batch_id: str, plan: list[PlannedLine], expires_at: datetime, tenant: str) -> None:
    done, results = stored_parts(ctx.storage, batch_id, len(plan))
    if done:
        log.info("batch %s: resuming at line %d of %d (the lines before it have stored results)", batch_id, done,
                 len(plan))
    settings = ctx.settings
    pacer = Pacer(Share(busy=max(1, round(settings.max_batch_size * settings.batch_share)),
                        idle=max(1, round(settings.max_batch_size * settings.batch_idle_share)),
                        time=settings.batch_share), tenant=tenant)
    grade_results(ctx, batch_id, results, pacer)  # an eval run's items stored before a restart and not graded
    while done < len(plan):
        _record(ctx, batch_id, done, results)
        status = _status(ctx, batch_id)
        if status == CANCELLING or utcnow() > expires_at:
            break
        chunk = plan[done:done + settings.batch_chunk_lines]
        part = run_chunk(ctx, batch_id, done, chunk, pacer)
        _put(ctx.storage, part_key(batch_id, done), Part(results=part).model_dump_json().encode())
        grade_results(ctx, batch_id, part, pacer)  # before the progress commit: a finished batch is graded
        results.extend(part)
        done += len(chunk)
    _record(ctx, batch_id, done, results)
    finish(ctx, batch_id, results, complete=done == len(plan))


def _status(ctx: WorkerContext, batch_id: str) -> str:
    with session_scope(ctx.sessions) as session:
        return str(session.scalar(select(Batch.status).where(Batch.id == batch_id)))


def _record(ctx: WorkerContext, batch_id: str, done: int, results: list[LineResult]) -> None:
    failed = sum(r.failed for r in results)
    with session_scope(ctx.sessions) as session:
        record_progress(session, batch_id, lines_done=done, completed=len(results) - failed, failed=failed)


def finish(ctx: WorkerContext, batch_id: str, results: list[LineResult], *, complete: bool) -> None:
    """Write the output and error files (/v1/files of purpose batch_output) and end the batch, in one commit."""
    if complete:
        with session_scope(ctx.sessions) as session:
            move(session, batch_id, FINALIZING)
    stored: dict[str, StoredFile] = {}  # written before the commit below: a redelivery rewrites the same keys
    kinds: tuple[tuple[Literal["output", "errors"], bool], ...] = (("output", False), ("errors", True))
    for kind, failed in kinds:
        lines = [r.line for r in results if r.failed == failed]
        if lines:
            data = b"".join(json.dumps(line, separators=(",", ":")).encode() + b"\n" for line in lines)
            _put(ctx.storage, result_key(batch_id, kind), data)
            stored[kind] = StoredFile(result_key(batch_id, kind), len(lines), len(data),
                                      hashlib.sha256(data).hexdigest())
    with session_scope(ctx.sessions) as session:
        row = get_batch(session, batch_id=batch_id, tenant=None, for_update=True)
        if row.status not in RUNNABLE:
            return
        ids = {kind: _file_row(session, row, kind, info) for kind, info in stored.items()}
        if row.status == CANCELLING:
            target = CANCELLED
        elif not complete:
            target = EXPIRED
        else:
            target = COMPLETED
        move(session, batch_id, target, output_file_id=ids.get("output"), error_file_id=ids.get("errors"))
    log.info("batch %s %s: %d lines", batch_id, target, len(results))


@dataclass
class StoredFile:
    key: str
    rows: int
    size: int
    sha256: str


def _file_row(session: Session, batch: Batch, kind: str, stored: StoredFile) -> str:
    """A /v1/files entry of the batch's tenant for a stored result file; its id."""
    file_id = new_id("file")
    name = f"{batch.id}_{kind}.jsonl"
    session.add(Dataset(id=file_id, tenant_id=batch.tenant_id, name=name, filename=name, format="jsonl",
                        rows=stored.rows, columns=list(COLUMNS), column_stats={}, sha256=stored.sha256,
                        size_bytes=stored.size, path=stored.key, created_at=utcnow(), purpose=OUTPUT_PURPOSE))
    session.flush()
    return file_id
