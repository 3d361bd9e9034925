"""Keeping jobs alive across failures: heartbeats, the reaper, broker-loss recovery, the cancel watchdog."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy.orm import Session, sessionmaker

from core import states
from core.db import session_scope
from core.errors import StaleAttempt
from core.periodic import Periodic
from core.protocol import ErrorCode
from core.queue import TaskQueue
from core.redis_client import redis_from_url
from core.redis_keys import BROKER_SENTINEL
from core.relay import deliver_now
from core.rows import EventKind, JobStatus, utcnow
from core.settings import Settings
from core.store import jobs as store
from core.store import outbox

log = logging.getLogger(__name__)

# Present in Redis while it still holds what it was sent; gone after a restart without persistence.
EXIT_CANCEL_TIMEOUT = 75


class Heartbeat:
    """While a job runs: beat every few seconds, and end the process if a cancel is not honoured in time."""

    def __init__(self, factory: sessionmaker[Session], settings: Settings, job_id: str, attempt: int,
                 exit_process: Callable[[int], None] = os._exit) -> None:
        self.factory = factory
        self.settings = settings
        self.job_id = job_id
        self.attempt = attempt
        self.exit_process = exit_process
        # Set when the row no longer belongs to this run (the reaper requeued it during a long outage and
        # another attempt claimed it): the attempt number works as a fencing token.
        self.lost = threading.Event()
        self.interval = max(0.5, min(settings.heartbeat_timeout_s / 4, 15.0))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{job_id}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a database blip must not kill the job; the next tick retries
                log.warning("heartbeat for %s failed", self.job_id, exc_info=True)

    def tick(self) -> None:
        """One beat, plus the watchdog: a cancel older than the grace period ends this worker process."""
        now = utcnow()
        with session_scope(self.factory) as session:
            if not store.beat(session, job_id=self.job_id, attempt=self.attempt, now=now):
                self.lost.set()
                return
            job = store.get_job(session, job_id=self.job_id)
            overdue = (job.cancel_requested_at is not None
                       and now - job.cancel_requested_at > timedelta(seconds=self.settings.cancel_grace_s))
            if overdue:
                states.move(session, job, JobStatus.CANCELLED, attempt=self.attempt, level="warning", now=now,
                            message="the worker did not stop in time; its process was ended to free the device")
        if overdue:
            log.error("job %s ignored its cancel for %.0f s; exiting", self.job_id, self.settings.cancel_grace_s)
            self.exit_process(EXIT_CANCEL_TIMEOUT)


def reap(factory: sessionmaker[Session], settings: Settings, queue: TaskQueue) -> list[str]:
    """Requeue running jobs whose worker went silent; fail those past the attempt limit. Returns requeued ids."""
    stale_before = utcnow() - timedelta(seconds=settings.heartbeat_timeout_s)
    requeued: list[str] = []
    with session_scope(factory) as session:
        candidates = [job.id for job in store.stale_jobs(session, stale_before=stale_before)]
    for job_id in candidates:
        try:
            with session_scope(factory) as session:
                job = store.get_job(session, job_id=job_id)
                if job.status != JobStatus.RUNNING:
                    continue
                if job.attempts >= settings.max_attempts:
                    states.move(session, job, JobStatus.FAILED, code=ErrorCode.WORKER_LOST,
                                message=f"the worker running this job was lost {job.attempts} times",
                                attempt=job.attempts, when=store.silent(stale_before))
                    continue
                # The outbox message commits with the requeue: no window where the row is queued unsent.
                states.move(session, job, JobStatus.QUEUED, kind=EventKind.REQUEUED, level="warning",
                            attempt=job.attempts, when=store.silent(stale_before),
                            message=f"worker silent for over {settings.heartbeat_timeout_s:g} s; "
                                    "requeued to resume from its last checkpoint")
        except StaleAttempt:
            continue  # another reaper, or the worker itself, got there first
        requeued.append(job_id)
        with factory() as session:
            deliver_now(session, queue, job_id=job_id)
    return requeued


def recover_broker(factory: sessionmaker[Session], settings: Settings, queue: TaskQueue) -> list[str]:
    """If Redis lost its data (or is new), re-enqueue every queued job from SQL. Returns the ids re-enqueued."""
    client = redis_from_url(settings.resolved_redis_url, socket_timeout=5)
    try:
        if not client.set(BROKER_SENTINEL, str(time.time()), nx=True):
            return []
        try:
            # One outbox message per queued job, committed together; duplicates of surviving messages are
            # harmless because claiming is conditional.
            with session_scope(factory) as session:
                jobs = store.jobs_in(session, statuses=[JobStatus.QUEUED])
                for job in jobs:
                    outbox.add_train(session, job_id=job.id, devices=job.devices)
                queued = [job.id for job in jobs]
        except Exception:
            client.delete(BROKER_SENTINEL)  # the next round (here or in another worker) tries again
            raise
    finally:
        client.close()
    with factory() as session:
        deliver_now(session, queue)
    if queued:
        log.warning("broker had no sentinel: re-enqueued %d queued jobs from SQL", len(queued))
    return queued


def reaper_thread(factory: sessionmaker[Session], settings: Settings, queue: TaskQueue) -> Periodic:
    """A daemon thread in each training worker running recover_broker() and reap() periodically."""

    def work() -> None:
        recover_broker(factory, settings, queue)
        reap(factory, settings, queue)

    return Periodic("reaper", max(1.0, min(settings.heartbeat_timeout_s / 2, 30.0)), work)
