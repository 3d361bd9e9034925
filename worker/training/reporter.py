"""JobReporter: the engine's callbacks, writing progress, metric points, events and checkpoints to the row
(each checkpoint uploaded to the artifact store before its row is written).

Every write carries the attempt number: once the attempt no longer holds the job (the reaper requeued it
and another worker claimed it) the store refuses the write, and the reporter tells the engine to stop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from core.db import session_scope
from core.errors import StaleAttempt
from core.rows import Artifact, WebhookEventType, new_id, utcnow
from core.paths import relative_to_home
from core.settings import Settings
from core.storage import ArtifactStore, open_storage
from core.store import jobs as store
from core.store import webhooks
from core.sweeps import prune_reason
from worker.engines.training import TrainCallbacks
from worker.sync import push_checkpoint

log = logging.getLogger(__name__)


def artifact_row(settings: Settings, job_id: str, kind: str, path: Path, step: int | None) -> Artifact:
    """An artifact row for a folder the engine wrote under home (its path relative to home is its storage key)."""
    files = [p for p in path.rglob("*") if p.is_file()]
    return Artifact(id=new_id("art"), job_id=job_id, kind=kind, path=relative_to_home(settings, path), step=step,
                    size_bytes=sum(p.stat().st_size for p in files),
                    files=sorted(str(p.relative_to(path)) for p in files), created_at=utcnow())


class JobReporter(TrainCallbacks):
    """Engine callbacks that write progress, metric points and events of one attempt to the job row."""

    def __init__(self, factory: sessionmaker[Session], settings: Settings, job_id: str, attempt: int, *,
                 lost: threading.Event | None = None, shutdown: threading.Event | None = None,
                 storage: ArtifactStore | None = None, sweep_id: str | None = None,
                 sinks: Sequence[TrainCallbacks] = (), receipt: dict[str, Any] | None = None) -> None:
        self.factory = factory
        self.sweep_id = sweep_id  # a sweep's child asks the sweep's pruning rule after each evaluation
        self.last_eval_step: int | None = None
        self.prune_detail: str | None = None
        self.settings = settings
        self.storage = storage or open_storage(settings)
        self.job_id = job_id
        self.attempt = attempt
        self.checkpoint_steps = settings.checkpoint_steps
        self.flush_s = settings.metrics_flush_s
        self.lost = lost or threading.Event()
        self.shutdown = shutdown or threading.Event()
        self.receipt = receipt  # completed with the device and precision the engine chose, in on_start
        self.points: list[tuple[int, float, str, float]] = []
        self.latest: dict[str, float] = {}
        self.progress: dict[str, Any] = {}
        self.total_steps: int | None = None
        self.started = time.monotonic()
        self.first_step: int | None = None
        self.last_flush = 0.0
        # Observers of the same callbacks (metrics exporter, TensorBoard); their failures never stop training.
        self.sinks = list(sinks)

    def on_start(self, info: dict[str, Any]) -> None:
        self.total_steps = int(info["total_steps"])
        resumed = int(info.get("resumed_from_step") or 0)
        self.first_step = resumed
        self.started = time.monotonic()
        message = (f"training on {info.get('device')} ({info.get('precision')}): {info.get('num_train')} train rows, "
                   f"{info.get('num_eval')} eval rows, {self.total_steps} steps")
        if resumed:
            message += f", resumed from checkpoint at step {resumed}"
        values: dict[str, Any] = {"total_steps": self.total_steps, "step": resumed, "device": info.get("device")}
        if self.receipt is not None:
            values["receipt"] = {**self.receipt, "device": info.get("device"), "precision": info.get("precision")}
        with self._fenced() as session:
            store.update_progress(session, job_id=self.job_id, attempt=self.attempt, values=values)
            store.add_event(session, job_id=self.job_id, kind="started", message=message, attempt=self.attempt,
                            data={k: v for k, v in info.items() if isinstance(v, (int, float, str))})
        self._notify("on_start", info)

    def on_log(self, step: int, epoch: float, metrics: dict[str, float]) -> None:
        self.points.extend((step, epoch, name, float(value)) for name, value in metrics.items())
        self.latest.update(metrics)
        self.progress = {"step": step, "epoch": epoch, "eta_seconds": self._eta(step)}
        self._notify("on_log", step, epoch, metrics)
        # The engine logs step N before it checkpoints step N: flushing here means a checkpoint never
        # gets ahead of the stored history, so a resume after a crash leaves no gap in it.
        checkpoint_next = self.checkpoint_steps is not None and step % self.checkpoint_steps == 0
        if checkpoint_next or time.monotonic() - self.last_flush >= self.flush_s:
            self.try_flush()

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.points.extend((step, self.progress.get("epoch", 0.0), name, float(v)) for name, v in metrics.items())
        self.latest.update(metrics)
        self.last_eval_step = step
        self._notify("on_eval", step, metrics)
        self.try_flush()
        summary = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
        self._event("eval", f"step {step}: {summary}", data=dict(metrics))

    def on_checkpoint(self, step: int, path: Path) -> None:
        if self.lost.is_set():
            return  # a newer attempt holds the job: its checkpoints in the store are not ours to replace
        try:
            push_checkpoint(self.storage, self.job_id, path)
        except Exception as exc:  # noqa: BLE001 - training goes on; the next checkpoint is uploaded again
            log.warning("job %s: checkpoint at step %d not stored", self.job_id, step, exc_info=True)
            self._event("checkpoint_not_stored", f"checkpoint at step {step} could not be stored ({exc}); "
                        "training goes on and the next one is tried", level="warning")
            return
        with self._fenced() as session:
            store.fence(session, job_id=self.job_id, attempt=self.attempt)
            job = store.get_job(session, job_id=self.job_id)
            for old in [a for a in job.artifacts if a.kind == "checkpoint"]:
                if not self.storage.exists(old.path):  # rotated away
                    session.delete(old)
            store.add_artifact(session, artifact=artifact_row(self.settings, self.job_id, "checkpoint", path, step),
                               attempt=self.attempt)
            store.add_event(session, job_id=self.job_id, kind="checkpoint", message=f"checkpoint at step {step}",
                            attempt=self.attempt)
            webhooks.emit(session, tenant_id=job.tenant_id, type=WebhookEventType.JOB_CHECKPOINT,
                          data=webhooks.job_data(job, checkpoint_step=step))

    def on_best(self, step: int, best: dict[str, Any]) -> None:
        try:
            with self._fenced() as session:
                store.update_progress(session, job_id=self.job_id, attempt=self.attempt, values={"best": best})
        except OperationalError:
            log.warning("job %s: database unavailable, best checkpoint recorded at the end", self.job_id)

    def stop_reason(self) -> str | None:
        if self.sweep_id is None or self.last_eval_step is None:
            return None
        try:
            with self.factory() as session:
                self.prune_detail = prune_reason(session, job_id=self.job_id, sweep_id=self.sweep_id,
                                                 step=self.last_eval_step)
        except OperationalError:
            return None  # database briefly away: keep training; the next evaluation asks again
        return "pruned" if self.prune_detail else None

    def on_event(self, kind: str, message: str) -> None:
        if kind == "pruned" and self.prune_detail:
            message = f"{self.prune_detail}; {message}"
        self._event(kind, message)

    def should_stop(self) -> bool:
        if self.shutdown.is_set() or self.lost.is_set():
            return True
        try:
            with self.factory() as session:
                return store.cancel_requested(session, job_id=self.job_id)
        except OperationalError:
            return False  # database briefly away: keep training; the next step asks again

    def close(self) -> None:
        """Close the sinks (the run ended, however it ended)."""
        self._notify("close")

    def _notify(self, method: str, *args: Any) -> None:
        for sink in self.sinks:
            try:
                getattr(sink, method)(*args)
            except Exception:  # noqa: BLE001 - an observer's failure must not fail the job
                log.warning("job %s: %s.%s failed", self.job_id, type(sink).__name__, method, exc_info=True)

    def try_flush(self) -> None:
        """Flush, but ride out a database outage: the points stay buffered for the next attempt."""
        try:
            self.flush()
        except OperationalError:
            log.warning("job %s: database unavailable, keeping %d metric points buffered", self.job_id,
                        len(self.points))
            self.last_flush = time.monotonic()
        except StaleAttempt:
            self._lose()

    def flush(self) -> None:
        """Write buffered points and the latest progress in one transaction (StaleAttempt if the job was lost)."""
        with session_scope(self.factory) as session:
            store.add_metric_points(session, job_id=self.job_id, attempt=self.attempt, points=self.points)
            store.update_progress(session, job_id=self.job_id, attempt=self.attempt, values={
                **self.progress, "metrics": dict(self.latest), "heartbeat_at": utcnow()})
        self.points = []
        self.last_flush = time.monotonic()

    def _eta(self, step: int) -> float | None:
        done = step - (self.first_step or 0)
        if not self.total_steps or done <= 0:
            return None
        per_step = (time.monotonic() - self.started) / done
        return round(per_step * max(self.total_steps - step, 0), 1)

    def _event(self, kind: str, message: str, level: str = "info", data: dict[str, Any] | None = None) -> None:
        try:
            with self._fenced() as session:
                store.add_event(session, job_id=self.job_id, kind=kind, level=level, message=message, data=data,
                                attempt=self.attempt)
        except OperationalError:
            log.warning("job %s: database unavailable, event %r not recorded", self.job_id, kind)

    @contextmanager
    def _fenced(self) -> Iterator[Session]:
        """A committing session; a refused write (StaleAttempt) marks this attempt lost instead of raising."""
        try:
            with session_scope(self.factory) as session:
                yield session
        except StaleAttempt:
            self._lose()

    def _lose(self) -> None:
        if not self.lost.is_set():
            log.warning("job %s: attempt %d no longer holds the job; its writes are refused", self.job_id,
                        self.attempt)
        self.lost.set()

