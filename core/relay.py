"""The outbox relay: send committed task messages to the broker and mark them sent, retrying refusals."""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy.orm import Session, sessionmaker

from core.errors import BrokerUnavailable
from core.periodic import Periodic
from core.queue import TaskQueue
from core.rows import JobStatus, utcnow
from core.store import outbox as store

log = logging.getLogger(__name__)

KEEP_SENT = timedelta(days=1)  # sent messages stay this long for inspection, then the relay deletes them


def deliver(session: Session, queue: TaskQueue, *, job_id: str | None = None, limit: int = 100) -> int:
    """Send unsent messages (only `job_id`'s when given) and commit; returns how many the broker took.

    Raises BrokerUnavailable after recording the refusal: the message stays unsent for the next round.
    A crash between sending and committing sends the message again later; duplicates are harmless
    because claiming a job is conditional.
    """
    sent = 0
    waiting: bool | None = None
    try:
        for message, status in store.take_unsent(session, job_id=job_id, limit=limit):
            if status != JobStatus.QUEUED:
                # A message only wakes a worker, which then claims whichever job's turn it is (core.job_order):
                # one for a job that no longer waits still stands in for another that does.
                waiting = store.any_queued(session) if waiting is None else waiting
                if not waiting:
                    store.mark_sent(session, message=message, task_id=None, now=utcnow())  # nothing left to run
                    continue
            try:
                task_id = queue.send(message.task, list(message.args), queue=message.queue, headers=message.headers)
            except BrokerUnavailable as exc:
                store.mark_refused(session, message=message, error=exc.message)
                session.commit()
                raise
            store.mark_sent(session, message=message, task_id=task_id, now=utcnow())
            sent += 1
        session.commit()
    except BaseException:
        session.rollback()
        raise
    return sent


def deliver_now(session: Session, queue: TaskQueue, *, job_id: str | None = None) -> int:
    """The fast path right after a commit: try once, leave a refusal to the relay thread."""
    try:
        return deliver(session, queue, job_id=job_id)
    except BrokerUnavailable as exc:
        log.warning("broker refused a task message (%s); the outbox relay will retry", exc.message)
        return 0


def relay_thread(factory: sessionmaker[Session], queue: TaskQueue, interval: float) -> Periodic:
    """A daemon thread that delivers unsent messages every `interval` seconds (backing off while refused)."""

    def work() -> None:
        with factory() as session:
            deliver(session, queue)
            store.prune_sent(session, before=utcnow() - KEEP_SENT)
            session.commit()

    return Periodic("outbox-relay", interval, work)
