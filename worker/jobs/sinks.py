"""What a training job's callbacks feed besides the row: a sweep's pruning rule and the observers (metrics
exporter, TensorBoard), whose failures never stop training."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from core.rows import EventKind
from core.sweeps import prune_reason
from worker.engines.training.loop import TrainCallbacks

log = logging.getLogger(__name__)


class SweepPruning:
    """A sweep child's pruning: after each evaluation, asks the sweep's rule whether this trial should stop."""

    def __init__(self, factory: sessionmaker[Session], job_id: str, sweep_id: str | None) -> None:
        self.factory = factory
        self.job_id = job_id
        self.sweep_id = sweep_id
        self.last_eval_step: int | None = None
        self.detail: str | None = None  # why the rule pruned this trial, for the event

    def stop_reason(self) -> str | None:
        """"pruned" when the sweep's rule stops this trial after its latest evaluation, else None."""
        if self.sweep_id is None or self.last_eval_step is None:
            return None
        try:
            with self.factory() as session:
                self.detail = prune_reason(session, job_id=self.job_id, sweep_id=self.sweep_id,
                                           step=self.last_eval_step)
        except OperationalError:
            return None  # database briefly away: keep training; the next evaluation asks again
        return EventKind.PRUNED if self.detail else None

    def message(self, kind: str, message: str) -> str:
        """An event's message, with the rule's reason in front of a pruned one."""
        return f"{self.detail}; {message}" if kind == EventKind.PRUNED and self.detail else message


class Observers:
    """Passes the engine's callbacks on to observers; one's failure is logged and never fails the job."""

    def __init__(self, job_id: str, sinks: Sequence[TrainCallbacks]) -> None:
        self.job_id = job_id
        self.sinks = list(sinks)

    def notify(self, method: str, *args: Any) -> None:
        """Call `method` on every observer."""
        for sink in self.sinks:
            try:
                getattr(sink, method)(*args)
            except Exception:  # noqa: BLE001 - an observer's failure must not fail the job
                log.warning("job %s: %s.%s failed", self.job_id, type(sink).__name__, method, exc_info=True)
