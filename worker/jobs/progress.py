"""The fenced progress writer of one attempt: buffered metric points, progress with an ETA, and events.

Every write carries the attempt number: once the attempt no longer holds the job (the reaper requeued it and
another worker claimed it) the store refuses the write, and the writer marks the attempt lost instead of raising.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from core.db import session_scope
from core.errors import StaleAttempt
from core.rows import utcnow
from core.store import jobs as store

log = logging.getLogger(__name__)


class Eta:
    """Seconds left, from the mean step time of this attempt (steps before a resume do not count)."""

    def __init__(self) -> None:
        self.total_steps: int | None = None
        self.first_step = 0
        self.started = time.monotonic()

    def start(self, total_steps: int, first_step: int) -> None:
        """The run starts (or resumes at `first_step`) now."""
        self.total_steps, self.first_step, self.started = total_steps, first_step, time.monotonic()

    def at(self, step: int) -> float | None:
        """Seconds left after `step`; None before the first step of this attempt."""
        done = step - self.first_step
        if not self.total_steps or done <= 0:
            return None
        per_step = (time.monotonic() - self.started) / done
        return round(per_step * max(self.total_steps - step, 0), 1)


class ProgressWriter:
    """Writes one attempt's metric points, progress and events to the job row, every write fenced by the attempt."""

    def __init__(self, factory: sessionmaker[Session], job_id: str, attempt: int, *, flush_s: float,
                 lost: threading.Event | None = None) -> None:
        self.factory = factory
        self.job_id = job_id
        self.attempt = attempt
        self.flush_s = flush_s
        self.lost = lost or threading.Event()
        self.points: list[tuple[int, float, str, float]] = []
        self.latest: dict[str, float] = {}
        self.progress: dict[str, Any] = {}
        self.last_flush = 0.0

    def record(self, step: int, epoch: float, metrics: dict[str, float]) -> None:
        """Buffer metric points of `step` and keep them as the latest values."""
        self.points.extend((step, epoch, name, float(value)) for name, value in metrics.items())
        self.latest.update(metrics)

    def flush_due(self) -> bool:
        """True when the buffer has waited TRAINSERVE_METRICS_FLUSH_S since the last flush."""
        return time.monotonic() - self.last_flush >= self.flush_s

    def try_flush(self) -> None:
        """Flush, but ride out a database outage: the points stay buffered for the next attempt."""
        try:
            self.flush()
        except OperationalError:
            log.warning("job %s: database unavailable, keeping %d metric points buffered", self.job_id,
                        len(self.points))
            self.last_flush = time.monotonic()
        except StaleAttempt:
            self.lose()

    def flush(self) -> None:
        """Write buffered points and the latest progress in one transaction (StaleAttempt if the job was lost)."""
        with session_scope(self.factory) as session:
            store.add_metric_points(session, job_id=self.job_id, attempt=self.attempt, points=self.points)
            store.update_progress(session, job_id=self.job_id, attempt=self.attempt, values={
                **self.progress, "metrics": dict(self.latest), "heartbeat_at": utcnow()})
        self.points = []
        self.last_flush = time.monotonic()

    def update(self, values: dict[str, Any]) -> None:
        """Write progress fields now, riding out a database outage (the lifecycle writes the result at the end)."""
        try:
            with self.fenced() as session:
                store.update_progress(session, job_id=self.job_id, attempt=self.attempt, values=values)
        except OperationalError:
            log.warning("job %s: database unavailable, %s recorded at the end", self.job_id, ", ".join(values))

    def event(self, kind: str, message: str, level: str = "info", data: dict[str, Any] | None = None) -> None:
        """Record an event of this attempt; a database outage loses it (logged), never the run."""
        try:
            with self.fenced() as session:
                store.add_event(session, job_id=self.job_id, kind=kind, level=level, message=message, data=data,
                                attempt=self.attempt)
        except OperationalError:
            log.warning("job %s: database unavailable, event %r not recorded", self.job_id, kind)

    @contextmanager
    def fenced(self) -> Iterator[Session]:
        """A committing session; a refused write (StaleAttempt) marks this attempt lost instead of raising."""
        try:
            with session_scope(self.factory) as session:
                yield session
        except StaleAttempt:
            self.lose()

    def lose(self) -> None:
        """This attempt no longer holds the job: every later write is skipped or refused, and the run stops."""
        if not self.lost.is_set():
            log.warning("job %s: attempt %d no longer holds the job; its writes are refused", self.job_id,
                        self.attempt)
        self.lost.set()
