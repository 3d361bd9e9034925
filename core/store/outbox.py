"""Data access for the outbox: task messages committed with the state change that needs them."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from core.rows import Job, JobStatus, OutboxMessage, utcnow
from core.tasks import TASK_TRAIN, train_queue


def add(session: Session, *, job_id: str, task: str, args: list[Any], queue: str,
        headers: dict[str, str] | None = None) -> OutboxMessage:
    """Write a message to send once the caller's transaction commits."""
    message = OutboxMessage(job_id=job_id, task=task, args=args, queue=queue, headers=headers, created_at=utcnow(),
                            attempts=0)
    session.add(message)
    session.flush()
    return message


def add_train(session: Session, *, job_id: str, devices: int, headers: dict[str, str] | None = None
              ) -> OutboxMessage:
    """The training task message that runs (or resumes) a queued job, on the queue of its device count.

    Without headers (a requeue by the reaper, outside any request) it takes the job's last ones, so the job
    keeps its request id.
    """
    if headers is None:
        headers = session.scalar(select(OutboxMessage.headers).where(OutboxMessage.job_id == job_id)
                                 .order_by(OutboxMessage.id.desc()).limit(1))
    return add(session, job_id=job_id, task=TASK_TRAIN, args=[job_id], queue=train_queue(devices), headers=headers)


def take_unsent(session: Session, *, job_id: str | None = None, limit: int = 100) -> list[tuple[OutboxMessage, str]]:
    """Unsent messages with their job's status, oldest first, locked so that two relays never send the same one."""
    query = (select(OutboxMessage, Job.status).join(Job, Job.id == OutboxMessage.job_id)
             .where(OutboxMessage.sent_at.is_(None)).order_by(OutboxMessage.id).limit(limit)
             .with_for_update(of=OutboxMessage, skip_locked=True))
    if job_id is not None:
        query = query.where(OutboxMessage.job_id == job_id)
    return [(message, status) for message, status in session.execute(query).tuples()]


def any_queued(session: Session) -> bool:
    """Whether any job waits in the queue."""
    return session.scalar(select(Job.id).where(Job.status == JobStatus.QUEUED).limit(1)) is not None


def mark_sent(session: Session, *, message: OutboxMessage, task_id: str | None, now: datetime) -> None:
    """Record that the broker took the message (task_id None: dropped, its job no longer needs it)."""
    message.sent_at = now
    message.attempts += 1
    if task_id is not None:
        # The task id lets a cancel revoke the queued message.
        session.execute(update(Job).where(Job.id == message.job_id).values(task_id=task_id))


def mark_refused(session: Session, *, message: OutboxMessage, error: str) -> None:
    """Record a refused send; the message stays unsent for the relay's next round."""
    message.attempts += 1
    message.last_error = error[:500]


def unsent(session: Session, *, job_id: str) -> list[OutboxMessage]:
    """A job's messages the broker has not taken yet."""
    query = select(OutboxMessage).where(OutboxMessage.job_id == job_id, OutboxMessage.sent_at.is_(None))
    return list(session.scalars(query.order_by(OutboxMessage.id)))


def prune_sent(session: Session, *, before: datetime) -> int:
    """Delete messages sent before `before` (kept a while only to show what was sent when)."""
    result = session.execute(delete(OutboxMessage).where(OutboxMessage.sent_at < before))
    return int(result.rowcount)  # type: ignore[attr-defined]
