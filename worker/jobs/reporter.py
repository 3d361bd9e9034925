"""JobReporter: the engine's callbacks for one attempt of a job, composed of smaller parts.

    progress     worker.jobs.progress.ProgressWriter: metric points, progress with an ETA, events (fenced)
    checkpoints  worker.jobs.publishing.CheckpointPublisher: upload, rotate, record, webhook
    pruning      worker.jobs.sinks.SweepPruning: a sweep child's early stop
    observers    worker.jobs.sinks.Observers: metrics exporter, TensorBoard
    cancel       should_stop: the worker's shutdown, a lost attempt, or the user's cancel on the row

Every write carries the attempt number: once the attempt no longer holds the job the store refuses the write,
and the reporter tells the engine to stop.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from core.rows import EventKind
from core.settings import Settings
from core.storage import ArtifactStore, open_storage
from core.store import jobs as store
from worker.engines.training.loop import TrainCallbacks, checkpoint_due
from worker.jobs.progress import Eta, ProgressWriter
from worker.jobs.publishing import CheckpointPublisher, artifact_row
from worker.jobs.sinks import Observers, SweepPruning

__all__ = ["JobReporter", "artifact_row"]  # artifact_row: the lifecycle records the final model with it


class JobReporter(TrainCallbacks):
    """Engine callbacks that write progress, metric points, events and checkpoints of one attempt to the job row."""

    def __init__(self, factory: sessionmaker[Session], settings: Settings, job_id: str, attempt: int, *,
                 lost: threading.Event | None = None, shutdown: threading.Event | None = None,
                 storage: ArtifactStore | None = None, sweep_id: str | None = None,
                 sinks: Sequence[TrainCallbacks] = (), receipt: dict[str, Any] | None = None) -> None:
        self.factory = factory
        self.job_id = job_id
        self.attempt = attempt
        self.shutdown = shutdown or threading.Event()
        self.receipt = receipt  # completed with the device and precision the engine chose, in on_start
        self.writer = ProgressWriter(factory, job_id, attempt, flush_s=settings.metrics_flush_s, lost=lost)
        self.lost = self.writer.lost
        self.checkpoints = CheckpointPublisher(settings, storage or open_storage(settings), self.writer)
        self.pruning = SweepPruning(factory, job_id, sweep_id)
        self.observers = Observers(job_id, sinks)
        self.eta = Eta()
        self.checkpoint_steps: int | None = None  # the run's, from on_start

    def on_start(self, info: dict[str, Any]) -> None:
        total_steps = int(info["total_steps"])
        resumed = int(info.get("resumed_from_step") or 0)
        self.checkpoint_steps = info.get("checkpoint_steps")
        self.eta.start(total_steps, resumed)
        message = (f"training on {info.get('device')} ({info.get('precision')}): {info.get('num_train')} train rows, "
                   f"{info.get('num_eval')} eval rows, {total_steps} steps")
        if resumed:
            message += f", resumed from checkpoint at step {resumed}"
        values: dict[str, Any] = {"total_steps": total_steps, "step": resumed, "device": info.get("device")}
        if self.receipt is not None:
            values["receipt"] = {**self.receipt, "device": info.get("device"), "precision": info.get("precision")}
        with self.writer.fenced() as session:
            store.update_progress(session, job_id=self.job_id, attempt=self.attempt, values=values)
            store.add_event(session, job_id=self.job_id, kind=EventKind.STARTED, message=message, attempt=self.attempt,
                            data={k: v for k, v in info.items() if isinstance(v, (int, float, str))})
        self.observers.notify("on_start", info)

    def on_log(self, step: int, epoch: float, metrics: dict[str, float]) -> None:
        self.writer.record(step, epoch, metrics)
        self.writer.progress = {"step": step, "epoch": epoch, "eta_seconds": self.eta.at(step)}
        self.observers.notify("on_log", step, epoch, metrics)
        # The engine logs step N before it checkpoints step N: flushing here means a checkpoint never
        # gets ahead of the stored history, so a resume after a crash leaves no gap in it.
        if checkpoint_due(step, self.checkpoint_steps) or self.writer.flush_due():
            self.writer.try_flush()

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.writer.record(step, self.writer.progress.get("epoch", 0.0), metrics)
        self.pruning.last_eval_step = step
        self.observers.notify("on_eval", step, metrics)
        self.writer.try_flush()
        summary = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
        self.writer.event(EventKind.EVAL, f"step {step}: {summary}", data=dict(metrics))

    def on_checkpoint(self, step: int, path: Path) -> None:
        self.checkpoints.publish(step, path)

    def on_best(self, step: int, best: dict[str, Any]) -> None:
        self.writer.update({"best": best})

    def stop_reason(self) -> str | None:
        return self.pruning.stop_reason()

    def on_event(self, kind: str, message: str) -> None:
        self.writer.event(kind, self.pruning.message(kind, message))

    def should_stop(self) -> bool:
        if self.shutdown.is_set() or self.lost.is_set():
            return True
        try:
            with self.factory() as session:
                return store.cancel_requested(session, job_id=self.job_id)
        except OperationalError:
            return False  # database briefly away: keep training; the next step asks again

    def close(self) -> None:
        """Close the observers (the run ended, however it ended)."""
        self.observers.notify("close")

    def try_flush(self) -> None:
        """Flush buffered points, riding out a database outage (ProgressWriter.try_flush)."""
        self.writer.try_flush()

    def flush(self) -> None:
        """Write buffered points and the latest progress now (StaleAttempt if the job was lost)."""
        self.writer.flush()
