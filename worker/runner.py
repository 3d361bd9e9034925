"""Runs a job recorded in SQL: claim the row, train, write progress and results back."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from core.db import make_engine, make_sessionmaker, session_scope
from core.errors import NotFound
from core.models import Artifact, Job, JobStatus, TaskKind, new_id, utcnow
from core.settings import get_settings
from core.store import datasets as dataset_store
from core.store import jobs as store
from core.tasks import QUEUE_TRAIN, TASK_TRAIN
from worker.app import SHUTDOWN, celery
from worker.engines.device import release_memory, resolve_device
from worker.engines.lm_training import LMTrainConfig, train_lm
from worker.engines.training import TrainCallbacks, TrainConfig, TrainResult, train
from worker.recovery import Heartbeat

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def sessions() -> sessionmaker[Session]:
    """One engine per worker process, created after the fork."""
    return make_sessionmaker(make_engine(get_settings().resolved_database_url))


def job_dir(job_id: str) -> Path:
    """Where a job's model and checkpoints live."""
    return get_settings().jobs_dir / job_id


class JobReporter(TrainCallbacks):
    """Engine callbacks that write progress, metric points and events to the job row."""

    def __init__(self, factory: sessionmaker[Session], job_id: str, flush_s: float,
                 lost: threading.Event | None = None, checkpoint_steps: int | None = None) -> None:
        self.factory = factory
        self.checkpoint_steps = checkpoint_steps
        self.lost = lost or threading.Event()
        self.job_id = job_id
        self.flush_s = flush_s
        self.points: list[tuple[int, float, str, float]] = []
        self.latest: dict[str, float] = {}
        self.progress: dict[str, Any] = {}
        self.total_steps: int | None = None
        self.started = time.monotonic()
        self.first_step: int | None = None
        self.last_flush = 0.0

    def on_start(self, info: dict[str, Any]) -> None:
        self.total_steps = int(info["total_steps"])
        resumed = int(info.get("resumed_from_step") or 0)
        self.first_step = resumed
        self.started = time.monotonic()
        message = (f"training on {info.get('device')} ({info.get('precision')}): {info.get('num_train')} train rows, "
                   f"{info.get('num_eval')} eval rows, {self.total_steps} steps")
        if resumed:
            message += f", resumed from checkpoint at step {resumed}"
        with session_scope(self.factory) as session:
            store.update_progress(session, job_id=self.job_id, values={
                "total_steps": self.total_steps, "step": resumed, "device": info.get("device")})
            store.add_event(session, job_id=self.job_id, kind="started", message=message,
                            data={k: v for k, v in info.items() if isinstance(v, (int, float, str))})

    def on_log(self, step: int, epoch: float, metrics: dict[str, float]) -> None:
        self.points.extend((step, epoch, name, float(value)) for name, value in metrics.items())
        self.latest.update(metrics)
        self.progress = {"step": step, "epoch": epoch, "eta_seconds": self._eta(step)}
        # The engine logs step N before it checkpoints step N: flushing here means a checkpoint never
        # gets ahead of the stored history, so a resume after a crash leaves no gap in it.
        checkpoint_next = self.checkpoint_steps is not None and step % self.checkpoint_steps == 0
        if checkpoint_next or time.monotonic() - self.last_flush >= self.flush_s:
            self.try_flush()

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.points.extend((step, self.progress.get("epoch", 0.0), name, float(v)) for name, v in metrics.items())
        self.latest.update(metrics)
        self.try_flush()
        summary = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
        self._event("eval", f"step {step}: {summary}", data=dict(metrics))

    def on_checkpoint(self, step: int, path: Path) -> None:
        home = get_settings().home.resolve()
        with session_scope(self.factory) as session:
            job = store.get_job(session, job_id=self.job_id)
            for old in [a for a in job.artifacts if a.kind == "checkpoint"]:
                if not (home / old.path).exists():  # rotated away by the engine
                    session.delete(old)
            store.add_artifact(session, artifact=_artifact(self.job_id, "checkpoint", path, step))
            store.add_event(session, job_id=self.job_id, kind="checkpoint", message=f"checkpoint at step {step}")

    def on_event(self, kind: str, message: str) -> None:
        self._event(kind, message)

    def should_stop(self) -> bool:
        if SHUTDOWN.is_set() or self.lost.is_set():
            return True
        try:
            with self.factory() as session:
                return store.cancel_requested(session, job_id=self.job_id)
        except OperationalError:
            return False  # database briefly away: keep training; the next step asks again

    def try_flush(self) -> None:
        """Flush, but ride out a database outage: the points stay buffered for the next attempt."""
        try:
            self.flush()
        except OperationalError:
            log.warning("job %s: database unavailable, keeping %d metric points buffered", self.job_id,
                        len(self.points))
            self.last_flush = time.monotonic()

    def flush(self) -> None:
        """Write buffered points and the latest progress in one transaction."""
        with session_scope(self.factory) as session:
            store.add_metric_points(session, job_id=self.job_id, points=self.points)
            store.update_progress(session, job_id=self.job_id, values={
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
            with session_scope(self.factory) as session:
                store.add_event(session, job_id=self.job_id, kind=kind, level=level, message=message, data=data)
        except OperationalError:
            log.warning("job %s: database unavailable, event %r not recorded", self.job_id, kind)


def _artifact(job_id: str, kind: str, path: Path, step: int | None) -> Artifact:
    home = get_settings().home.resolve()
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return Artifact(id=new_id("art"), job_id=job_id, kind=kind, path=str(path.resolve().relative_to(home)),
                    step=step, size_bytes=size, files=files, created_at=utcnow())


def build_config(job: Job, train_path: Path, eval_path: Path | None, hashes: dict[str, str],
                 device: str) -> TrainConfig | LMTrainConfig:
    """The engine's frozen config from a job row."""
    settings = get_settings()
    hp = job.hyperparameters
    out = job_dir(job.id)
    if job.task == TaskKind.CAUSAL_LM:
        return LMTrainConfig(
            train_file=train_path, eval_file=eval_path, output_dir=out / "model", checkpoint_dir=out / "checkpoints",
            base_model=job.base_model_path, model_config=job.model_config_, text_column=job.text_column,
            val_fraction=hp["val_fraction"], block_size=hp["block_size"], epochs=hp["epochs"],
            max_steps=hp["max_steps"], batch_size=hp["batch_size"], learning_rate=hp["learning_rate"],
            warmup_ratio=hp["warmup_ratio"], weight_decay=hp["weight_decay"],
            gradient_accumulation_steps=hp["gradient_accumulation_steps"], precision=hp["precision"],
            seed=hp["seed"], eval_steps=hp["eval_steps"], checkpoint_steps=settings.checkpoint_steps,
            device=device, memory_limit_bytes=settings.worker_memory_bytes or None,
            base_model_name=job.base_model or "", dataset_hashes=hashes)
    assert job.base_model_path is not None and job.label_column is not None
    return TrainConfig(
        base_model=job.base_model_path, base_model_name=job.base_model or "", train_file=train_path,
        eval_file=eval_path, text_column=job.text_column, label_column=job.label_column,
        output_dir=out / "model", checkpoint_dir=out / "checkpoints", epochs=hp["epochs"],
        max_steps=hp["max_steps"], batch_size=hp["batch_size"], learning_rate=hp["learning_rate"],
        warmup_ratio=hp["warmup_ratio"], weight_decay=hp["weight_decay"], max_length=hp["max_length"],
        gradient_accumulation_steps=hp["gradient_accumulation_steps"], precision=hp["precision"],
        seed=hp["seed"], eval_steps=hp["eval_steps"], checkpoint_steps=settings.checkpoint_steps,
        device=device, memory_limit_bytes=settings.worker_memory_bytes or None, dataset_hashes=hashes,
    )


def run_training_job(job_id: str) -> str:
    """Claim and run a job; returns the status it ended in (or 'skipped' for a finished job)."""
    settings = get_settings()
    factory = sessions()
    with session_scope(factory) as session:
        now = utcnow()
        stale_before = now - timedelta(seconds=settings.heartbeat_timeout_s)
        try:
            job = store.claim_job(session, job_id=job_id, device=settings.worker_device, now=now,
                                  stale_before=stale_before)
        except NotFound:
            log.warning("job %s does not exist; dropping its task", job_id)
            return "skipped"
        if job is None:
            return "skipped"
        if job.cancel_requested_at is not None:
            _finish(session, job, JobStatus.CANCELLED, "cancelled before training started")
            return JobStatus.CANCELLED
        try:
            config = _config_for(session, job, settings.worker_device)
        except ValueError as exc:
            _fail(session, job, "dataset_missing", str(exc))
            return JobStatus.FAILED
        store.add_event(session, job_id=job_id, kind="claimed", message=f"attempt {job.attempts} claimed by a worker")
        attempt = job.attempts

    heartbeat = Heartbeat(factory, settings, job_id, attempt)
    reporter = JobReporter(factory, job_id, settings.metrics_flush_s, heartbeat.lost, config.checkpoint_steps)
    try:
        with heartbeat:
            result = train_lm(config, reporter) if isinstance(config, LMTrainConfig) else train(config, reporter)
    except Exception as exc:  # noqa: BLE001 - any failure ends the job with a recorded reason
        log.exception("job %s failed", job_id)
        code = getattr(exc, "code", "training_error")  # OutOfMemory: oom, DoesNotFit: does_not_fit
        with session_scope(factory) as session:
            _fail(session, store.get_job(session, job_id=job_id), code, f"{type(exc).__name__}: {exc}")
        return JobStatus.FAILED
    finally:
        release_memory_of(config)
    if heartbeat.lost.is_set():
        log.warning("job %s attempt %d lost its claim; leaving the row to the newer attempt", job_id, attempt)
        return "lost"
    reporter.flush()
    return _record_result(factory, job_id, result)


def release_memory_of(config: TrainConfig | LMTrainConfig) -> None:
    """Give the device's cached memory back once a job ends, however it ended."""
    release_memory(resolve_device(config.device, config.precision))


def _config_for(session: Session, job: Job, device: str) -> TrainConfig | LMTrainConfig:
    home = get_settings().home
    if job.train_dataset_id is None:
        raise ValueError("the training dataset was deleted")
    train_ds = dataset_store.get_dataset(session, dataset_id=job.train_dataset_id)
    hashes = {"train": train_ds.sha256}
    eval_path = None
    if job.eval_dataset_id is not None:
        eval_ds = dataset_store.get_dataset(session, dataset_id=job.eval_dataset_id)
        eval_path = home / eval_ds.path
        hashes["eval"] = eval_ds.sha256
    return build_config(job, home / train_ds.path, eval_path, hashes, device)


def _record_result(factory: sessionmaker[Session], job_id: str, result: TrainResult) -> str:
    with session_scope(factory) as session:
        job = store.get_job(session, job_id=job_id)
        job.metrics = {**(job.metrics or {}), **result.metrics}
        job.step = result.global_step
        if result.status == "completed" and result.model_dir is not None:
            store.add_artifact(session, artifact=_artifact(job_id, "model", result.model_dir, result.global_step))
            _finish(session, job, JobStatus.SUCCEEDED, f"finished after {result.global_step} steps")
        elif job.cancel_requested_at is None and SHUTDOWN.is_set():
            # The worker is stopping, not the user: checkpointed, so put the job back in the queue.
            job.status = JobStatus.QUEUED
            job.eta_seconds = None
            store.add_event(session, job_id=job_id, kind="preempted",
                            message=f"worker shut down at step {result.global_step}; requeued to resume")
        else:
            _finish(session, job, JobStatus.CANCELLED, f"cancelled at step {result.global_step}")
        status = job.status
    if status == JobStatus.QUEUED:
        send_train(job_id)
    return status


def send_train(job_id: str) -> None:
    """Put a job's task (back) on the training queue."""
    celery.send_task(TASK_TRAIN, args=[job_id], queue=QUEUE_TRAIN)


def _finish(session: Session, job: Job, status: JobStatus, message: str, level: str = "info") -> None:
    job.status = status
    job.finished_at = utcnow()
    job.eta_seconds = None
    store.add_event(session, job_id=job.id, kind=str(status), message=message, level=level)


def _fail(session: Session, job: Job, code: str, message: str) -> None:
    job.error = {"code": code, "message": message, "field": None}
    _finish(session, job, JobStatus.FAILED, message, level="error")


@lru_cache(maxsize=1)
def _classifiers() -> Any:
    from worker.engines.classify import ClassifierCache

    return ClassifierCache()


def classify_texts(job_id: str, texts: list[str]) -> list[dict[str, Any]]:
    """Predictions from a finished job's model; the model stays loaded in this process."""
    model_dir = job_dir(job_id) / "model"
    if not (model_dir / "manifest.json").is_file():
        raise FileNotFoundError(f"model of job {job_id} is not on this worker's disk")
    result: list[dict[str, Any]] = _classifiers().get(model_dir).predict(texts)
    return result
