"""Data access for jobs, their metric points, events and artifacts."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from core.errors import NotFound, StaleAttempt
from core.public_text import public_text
from core.rows import Artifact, EventKind, Job, JobEvent, JobStatus, MetricPoint, is_valid_id, utcnow
from core.store.owned import get_owned
from core.store.paging import before_cursor


def get_job(session: Session, *, job_id: str, tenant: str | None = None, for_update: bool = False) -> Job:
    """Fetch a job visible to `tenant` (None: any) or raise NotFound."""
    return get_owned(session, Job, job_id, what="job", tenant=tenant, for_update=for_update)


def list_jobs(session: Session, *, limit: int, tenant: str | None = None, status: str | None = None,
              after: tuple[str, str] | None = None) -> list[Job]:
    """Newest first, optionally filtered by status."""
    query = select(Job).order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)
    if tenant is not None:
        query = query.where(Job.tenant_id == tenant)
    if status is not None:
        query = query.where(Job.status == status)
    if after is not None:
        query = query.where(before_cursor(Job, after))
    return list(session.scalars(query))


def held_by(job_id: str, attempt: int) -> ColumnElement[bool]:
    """The fencing condition: the job is running in attempt `attempt` (claims bump the number)."""
    return and_(Job.id == job_id, Job.status == JobStatus.RUNNING, Job.attempts == attempt)


def fence(session: Session, *, job_id: str, attempt: int) -> None:
    """Lock the job row for this transaction if `attempt` still holds it; StaleAttempt otherwise.

    The lock keeps a claim or requeue from changing the attempt number before the caller's writes commit.
    """
    if session.scalar(select(Job.id).where(held_by(job_id, attempt)).with_for_update()) is None:
        raise StaleAttempt(f"attempt {attempt} no longer holds job {job_id}; write refused")


def add_event(session: Session, *, job_id: str, kind: str, message: str, level: str = "info",
              data: dict[str, Any] | None = None, attempt: int | None = None) -> JobEvent:
    """Append an event to a job's log; with `attempt`, only while that attempt holds the job."""
    if attempt is not None:
        fence(session, job_id=job_id, attempt=attempt)
    event = JobEvent(job_id=job_id, kind=kind, level=level, message=public_text(message), data=data,
                     created_at=utcnow())
    session.add(event)
    session.flush()
    return event


def list_events(session: Session, *, job_id: str, after_id: int = 0, limit: int = 100) -> list[JobEvent]:
    """Events in the order they happened, after a given event id."""
    query = (select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.id > after_id)
             .order_by(JobEvent.id).limit(limit))
    return list(session.scalars(query))


def list_events_newest_first(session: Session, *, job_id: str, before_id: int | None = None,
                             limit: int = 20) -> list[JobEvent]:
    """Events newest first (OpenAI's order), before a given event id."""
    query = select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id.desc()).limit(limit)
    if before_id is not None:
        query = query.where(JobEvent.id < before_id)
    return list(session.scalars(query))


def started_data(session: Session, *, job_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The data of each job's latest `started` event (what its engine reported when its last attempt began)."""
    if not job_ids:
        return {}
    latest = (select(func.max(JobEvent.id)).where(JobEvent.job_id.in_(list(job_ids)),
                                                  JobEvent.kind == EventKind.STARTED).group_by(JobEvent.job_id))
    rows = session.execute(select(JobEvent.job_id, JobEvent.data).where(JobEvent.id.in_(latest)))
    return {job_id: data or {} for job_id, data in rows}


def add_metric_points(session: Session, *, job_id: str, attempt: int,
                      points: Iterable[tuple[int, float, str, float]]) -> None:
    """Insert (step, epoch, name, value) points of attempt `attempt`; a point stored for (name, step) is kept."""
    fence(session, job_id=job_id, attempt=attempt)
    rows = [{"job_id": job_id, "step": step, "epoch": epoch, "name": name, "value": value,
             "created_at": utcnow()} for step, epoch, name, value in points]
    if not rows:
        return
    # A resumed job replays steps after its last checkpoint; the first value written for a step wins.
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    session.execute(insert(MetricPoint).values(rows).on_conflict_do_nothing(
        index_elements=["job_id", "name", "step"]))


def list_metric_points(session: Session, *, job_id: str, since_step: int = 0,
                       names: Sequence[str] | None = None, limit: int = 10_000) -> list[MetricPoint]:
    """Metric history for charts, ordered by step then name."""
    query = (select(MetricPoint).where(MetricPoint.job_id == job_id, MetricPoint.step >= since_step)
             .order_by(MetricPoint.step, MetricPoint.name).limit(limit))
    if names:
        query = query.where(MetricPoint.name.in_(list(names)))
    return list(session.scalars(query))


def add_artifact(session: Session, *, artifact: Artifact, attempt: int) -> Artifact:
    """Record an artifact produced by attempt `attempt` of a job, only while that attempt holds it."""
    fence(session, job_id=artifact.job_id, attempt=attempt)
    session.add(artifact)
    session.flush()
    return artifact


def get_artifact(session: Session, *, job_id: str, artifact_id: str) -> Artifact:
    """Fetch one of a job's artifacts or raise NotFound."""
    artifact = session.get(Artifact, artifact_id) if is_valid_id(artifact_id) else None
    if artifact is None or artifact.job_id != job_id:
        raise NotFound(f"artifact {artifact_id!r} not found on job {job_id!r}")
    return artifact


def count_jobs(session: Session, *, tenant: str, statuses: Sequence[str]) -> int:
    """How many of a tenant's jobs are in the given statuses."""
    query = select(func.count()).select_from(Job).where(Job.tenant_id == tenant, Job.status.in_(list(statuses)))
    return session.scalar(query) or 0


def silent(stale_before: datetime) -> ColumnElement[bool]:
    """The job's worker has not beaten since `stale_before`."""
    return or_(Job.heartbeat_at.is_(None), Job.heartbeat_at < stale_before)


def beat(session: Session, *, job_id: str, attempt: int, now: datetime) -> bool:
    """Record that attempt `attempt` is alive; False when it no longer holds the job."""
    result = session.execute(update(Job).where(held_by(job_id, attempt)).values(heartbeat_at=now)
                             .execution_options(synchronize_session=False))
    return bool(result.rowcount)  # type: ignore[attr-defined]


def stale_jobs(session: Session, *, stale_before: datetime) -> list[Job]:
    """Running jobs whose worker has not beaten since `stale_before`."""
    return list(session.scalars(select(Job).where(Job.status == JobStatus.RUNNING, silent(stale_before))))


def jobs_in(session: Session, *, statuses: Sequence[str]) -> list[Job]:
    """All jobs in the given statuses, oldest first (used to re-enqueue after a broker loss)."""
    return list(session.scalars(select(Job).where(Job.status.in_(list(statuses))).order_by(Job.created_at)))


def cancel_requested(session: Session, *, job_id: str) -> bool:
    """True once someone asked to cancel the job (cheap: one indexed column)."""
    return session.scalar(select(Job.cancel_requested_at).where(Job.id == job_id)) is not None


def update_progress(session: Session, *, job_id: str, attempt: int, values: dict[str, Any]) -> None:
    """Write progress columns of a running job without loading the row; StaleAttempt if `attempt` lost it."""
    result = session.execute(update(Job).where(held_by(job_id, attempt)).values(**values)
                             .execution_options(synchronize_session=False))
    if not result.rowcount:  # type: ignore[attr-defined]
        raise StaleAttempt(f"attempt {attempt} no longer holds job {job_id}; progress refused")


def status_counts(session: Session) -> dict[str, int]:
    """How many jobs are in each status, over every tenant (for the operators' metrics)."""
    query = select(Job.status, func.count()).group_by(Job.status)
    return {str(status): int(count) for status, count in session.execute(query).tuples()}


def oldest_queued_at(session: Session) -> datetime | None:
    """When the oldest job still queued was created (None when none is)."""
    return session.scalar(select(func.min(Job.created_at)).where(Job.status == JobStatus.QUEUED))
