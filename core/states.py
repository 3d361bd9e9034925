"""The job state machine: the table of legal moves and the one function that makes them.

    queued  -> running     a worker claimed it: `claim`, which core.job_order (whose turn) and `claim_job`
                           (a silent running job, requeued and claimed in one step) call
    queued  -> cancelled   cancelled before it started
    queued  -> failed      refused before it could start
    running -> queued      preempted (worker shutdown) or requeued by the reaper: an outbox message goes with it
    running -> succeeded | failed | cancelled
Terminal statuses never change. `move` is one conditional UPDATE (from-status, and optionally the attempt
number as a fencing token) plus the job event, plus an outbox message when the job goes back to the queue,
plus the webhook event of the new status. Leaving `running` adds the run's device seconds to the job (fair
share) and, when the tenant has jobs waiting, a wake-up message: a device limit may have held them back.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select, update
from sqlalchemy.orm import Session

from core.errors import IllegalTransition, StaleAttempt
from core.logs import task_headers
from core.public_text import public_text
from core.rows import TERMINAL, EventKind, Job, JobEvent, JobStatus, WebhookEventType, is_valid_id, utcnow
from core.store import jobs as jobs_store
from core.store import outbox, webhooks

TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.RUNNING, JobStatus.CANCELLED, JobStatus.FAILED}),
    JobStatus.RUNNING: frozenset({JobStatus.QUEUED, JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}


WEBHOOK_EVENT: dict[JobStatus, WebhookEventType] = {
    JobStatus.QUEUED: WebhookEventType.JOB_QUEUED,
    JobStatus.RUNNING: WebhookEventType.JOB_STARTED,
    JobStatus.SUCCEEDED: WebhookEventType.JOB_SUCCEEDED,
    JobStatus.FAILED: WebhookEventType.JOB_FAILED,
    JobStatus.CANCELLED: WebhookEventType.JOB_CANCELLED,
}


def allowed(source: str, target: str) -> bool:
    """Whether the table connects `source` to `target`."""
    return JobStatus(target) in TRANSITIONS[JobStatus(source)]


def sources(target: JobStatus) -> frozenset[JobStatus]:
    """The statuses a job may move to `target` from (conditional UPDATEs derive their WHERE from this)."""
    return frozenset(s for s, targets in TRANSITIONS.items() if target in targets)


# Queued jobs of one tenant in the order they run: highest priority, then oldest (core.job_order reads it too).
QUEUE_ORDER = (Job.priority.desc(), Job.created_at, Job.id)


def create(session: Session, job: Job, *, message: str = "job created and queued") -> Job:
    """Insert a new queued job with its `created` event and the outbox message that will run it."""
    job.status = JobStatus.QUEUED
    session.add(job)
    session.flush()
    _event(session, job.id, kind=EventKind.CREATED, level="info", message=message, data=None, now=job.created_at)
    outbox.add_train(session, job_id=job.id, devices=job.devices, headers=task_headers())
    webhooks.emit(session, tenant_id=job.tenant_id, type=WebhookEventType.JOB_QUEUED, data=webhooks.job_data(job),
                  now=job.created_at)
    return job


def move(session: Session, job: Job, target: JobStatus, *, message: str, kind: EventKind | None = None,
         level: str | None = None, code: str | None = None, attempt: int | None = None,
         when: ColumnElement[bool] | None = None, data: dict[str, Any] | None = None,
         now: datetime | None = None) -> Job:
    """Move `job` to `target`: status, timestamps, ETA, error and event together; the caller commits.

    Raises IllegalTransition when the table forbids the move, and StaleAttempt when the row is no longer
    in the status it was read in, no longer held by `attempt`, or fails the extra condition `when`.
    """
    source = JobStatus(job.status)
    if target not in TRANSITIONS[source]:
        raise IllegalTransition(f"job {job.id} cannot move from {source} to {target}", field="status")
    if target == JobStatus.FAILED and code is None:
        raise ValueError("a failure needs an error code")
    now = now or utcnow()
    values: dict[str, Any] = {"status": target}
    if target == JobStatus.RUNNING:
        values.update(started_at=func.coalesce(Job.started_at, now), heartbeat_at=now)
    if target == JobStatus.RUNNING:
        values["claimed_at"] = now
    if source == JobStatus.RUNNING:
        values["eta_seconds"] = None  # an ETA means something only while the job runs
        if job.claimed_at is not None:
            values["run_seconds"] = Job.run_seconds + max((now - job.claimed_at).total_seconds(), 0.0)
    if target in TERMINAL:
        values["finished_at"] = now
    if target == JobStatus.FAILED:
        values["error"] = {"code": code, "message": public_text(message), "field": None}
    conditions = [Job.id == job.id, Job.status == source]
    if attempt is not None:
        conditions.append(Job.attempts == attempt)
    if when is not None:
        conditions.append(when)
    result = session.execute(update(Job).where(*conditions).values(**values)
                             .execution_options(synchronize_session=False))
    if result.rowcount == 0:  # type: ignore[attr-defined]
        raise StaleAttempt(f"job {job.id} is no longer {source}" + (f" in attempt {attempt}" if attempt else ""))
    session.refresh(job)
    _event(session, job.id, kind=kind or EventKind(target), level=level or _level(target), message=message,
           data=data, now=now)
    if target == JobStatus.QUEUED:
        # a requeue keeps the request id
        outbox.add_train(session, job_id=job.id, devices=job.devices, headers=task_headers())
    elif source == JobStatus.RUNNING:
        waiting = _next_queued(session, tenant=job.tenant_id)
        if waiting is not None:  # a wake-up for jobs a device limit held back (with that job's own request id)
            outbox.add_train(session, job_id=waiting.id, devices=waiting.devices)
    webhooks.emit(session, tenant_id=job.tenant_id, type=WEBHOOK_EVENT[target], data=webhooks.job_data(job), now=now)
    return job


def claim(session: Session, *, job_id: str, attempt: int, device: str, now: datetime,
          when: ColumnElement[bool]) -> Job | None:
    """Move a job to running as attempt `attempt` + 1 on `device`: one conditional UPDATE (the row still in
    attempt `attempt`, the fencing token, and meeting `when`, the caller's choice of claimable), the `claimed`
    event and the job.started webhook. None when another claim won; the caller commits."""
    result = session.execute(
        update(Job).where(Job.id == job_id, Job.attempts == attempt, when)
        .values(status=JobStatus.RUNNING, device=device, attempts=attempt + 1, claimed_at=now,
                started_at=func.coalesce(Job.started_at, now), heartbeat_at=now)
        .execution_options(synchronize_session=False))
    if result.rowcount == 0:  # type: ignore[attr-defined]
        return None
    job = session.get(Job, job_id)
    assert job is not None
    session.refresh(job)
    _event(session, job.id, kind=EventKind.CLAIMED, level="info", message=f"attempt {job.attempts} claimed by a worker",
           data=None, now=now)
    webhooks.emit(session, tenant_id=job.tenant_id, type=WebhookEventType.JOB_STARTED, data=webhooks.job_data(job),
                  now=now)
    return job


def _next_queued(session: Session, *, tenant: str) -> Job | None:
    """A tenant's next queued job, if any (a wake-up message is attached to it, on its size's queue)."""
    query = select(Job).where(Job.tenant_id == tenant, Job.status == JobStatus.QUEUED).order_by(*QUEUE_ORDER)
    return session.scalars(query.limit(1)).first()


def _level(target: JobStatus) -> str:
    return "error" if target == JobStatus.FAILED else "info"


def _event(session: Session, job_id: str, *, kind: str, level: str, message: str, data: dict[str, Any] | None,
           now: datetime) -> None:
    session.add(JobEvent(job_id=job_id, kind=kind, level=level, message=public_text(message), data=data,
                         created_at=now))
    session.flush()


def claim_job(session: Session, *, job_id: str, device: str, now: datetime, stale_before: datetime,
              include_queued: bool = True) -> Job | None:
    """Atomically move a queued job (or a running one whose worker went silent) to running.

    Returns None when the job is finished or another live worker holds it: a duplicate or redelivered
    task message is then harmless. `claim` makes the move (one conditional UPDATE, fenced by the
    attempt number read here), safe on SQLite and PostgreSQL alike.
    Workers pick queued jobs with core.job_order.claim_next and pass include_queued=False here, to take
    back only a silent running job named by a redelivered message.
    """
    # A silent running job is requeued and claimed in one step (running -> queued -> running).
    silent_running = and_(Job.status.in_(sources(JobStatus.QUEUED)), jobs_store.silent(stale_before))
    claimable = or_(Job.status.in_(sources(JobStatus.RUNNING)), silent_running) if include_queued else silent_running
    attempt = session.scalar(select(Job.attempts).where(Job.id == job_id)) if is_valid_id(job_id) else None
    if attempt is None:
        jobs_store.get_job(session, job_id=job_id)  # NotFound, in the words of every job lookup
        return None
    return claim(session, job_id=job_id, attempt=attempt, device=device, now=now, when=claimable)
