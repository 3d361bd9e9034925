"""A training job's lifecycle: claim the row, fetch its inputs, run the engine, store the model, record how it
ended; every move via core.states."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from core import gang, job_order, states
from core.columns import BestEval
from core.db import session_scope
from core.errors import NotFound, StaleAttempt
from core.logs import bound
from core.paths import relative_to_home
from core.protocol import ErrorCode
from core.relay import deliver_now
from core.rows import ArtifactKind, EventKind, Job, JobStatus, is_valid_id, utcnow
from core.store import jobs as store
from core.sweeps import advance_and_send
from worker.batches.grading import start_fine_tuned_runs
from worker.context import WorkerContext
from worker.engines.device import release_memory, resolve_device
from worker.engines.training.kinds import run_task
from worker.engines.training.launch import train_on_devices
from worker.engines.training.loop import TrainResult, run
from worker.jobs.config import EngineConfig, JobInputs, config_for, job_inputs, resolve_job
from worker.jobs.gang import lead
from worker.jobs.prometheus import TrainingMetrics
from worker.jobs.receipt import base_receipt
from worker.jobs.recovery import Heartbeat
from worker.jobs.reporter import JobReporter, artifact_row
from worker.jobs.sync import clear_work, pull_checkpoint, push_model
from worker.jobs.tensorboard import TensorBoardSink, tensorboard_dir
from worker.metrics import JOB_DURATION, JOB_QUEUE_WAIT
from worker.model_store import storage_errors

log = logging.getLogger(__name__)

SKIPPED = "skipped"  # the job was finished, unknown, or held by a live worker
LOST = "lost"  # the attempt stopped holding the job while it ran: its writes were refused
# On several nodes a lost peer reaches rank 0 as a plain RuntimeError of gloo or NCCL, which looks like any failing
# step: such an attempt is retried from its last checkpoint, up to max_attempts, rather than failed at once.
RETRIED_ON_SEVERAL_NODES = frozenset({ErrorCode.NODE_LOST, ErrorCode.TRAINING_ERROR})


def run_training_job(ctx: WorkerContext, job_id: str) -> str:
    """Claim the job whose turn it is (core.job_order; `job_id`, the message's job, only if it was running on a
    worker that went silent) and run it; returns the status it ended in, 'skipped' or 'lost'. A sweep's child,
    once ended, lets its sweep create the next children."""
    ran: list[str] = []
    status = _run(ctx, job_id, ran)
    if ran and status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED):
        clear_work(ctx.storage, ctx.settings, ran[0])  # the store has all that is kept; no host hoards copies
    if ran and status == JobStatus.SUCCEEDED:
        start_fine_tuned_runs(ctx, ran[0])  # the job's eval on its result (its base run started with the job)
    if ran and status not in (SKIPPED, LOST, JobStatus.QUEUED):
        with ctx.sessions() as session:
            sweep_id = session.scalar(select(Job.sweep_id).where(Job.id == ran[0]))
        if sweep_id is not None:
            try:
                advance_and_send(ctx.sessions, ctx.queue, ctx.settings, sweep_id=sweep_id)
            except Exception:  # noqa: BLE001 - the periodic sweep round creates them instead
                log.warning("sweep %s: could not advance after job %s ended", sweep_id, ran[0], exc_info=True)
    return status


def _run(ctx: WorkerContext, job_id: str, ran: list[str]) -> str:
    """Claim, run and record one job; appends the id of the job it claimed to `ran`."""
    settings = ctx.settings
    started = time.monotonic()
    with session_scope(ctx.sessions) as session:
        job = _claim(ctx, session, job_id)
        if job is None:
            return SKIPPED
        job_id, attempt, task, hyperparameters = job.id, job.attempts, str(job.task), dict(job.hyperparameters)
        ran.append(job_id)
        if attempt == 1:  # a resumed attempt's wait started at its requeue, which the row does not keep
            JOB_QUEUE_WAIT.labels(task).observe(max((utcnow() - job.created_at).total_seconds(), 0.0))
        if job.cancel_requested_at is not None:
            states.move(session, job, JobStatus.CANCELLED, attempt=attempt,
                        message="cancelled before training started")
            return JobStatus.CANCELLED
        if job.devices > settings.worker_devices:  # routed by queue, so only a hand-made consumer gets here
            states.move(session, job, JobStatus.FAILED, code=ErrorCode.DOES_NOT_FIT, attempt=attempt,
                        message=f"the job asks for {job.devices} devices; this worker owns {settings.worker_devices}")
            return JobStatus.FAILED
        try:
            inputs = job_inputs(session, job)
        except ValueError as exc:
            states.move(session, job, JobStatus.FAILED, code=ErrorCode.DATASET_MISSING, message=str(exc),
                        attempt=attempt)
            return JobStatus.FAILED
        sweep_id = job.sweep_id
    with bound(job_id=job_id):  # the job it claimed, which may not be the message's
        log.info("job %s attempt %d claimed", job_id, attempt)
        status = _train(ctx, job, attempt, inputs, hyperparameters, sweep_id)
        log.info("job %s attempt %d ended: %s", job_id, attempt, status)
    JOB_DURATION.labels(task, status).observe(time.monotonic() - started)
    return status


def _train(ctx: WorkerContext, job: Job, attempt: int, inputs: JobInputs, hyperparameters: dict,
           sweep_id: str | None) -> str:
    settings, job_id = ctx.settings, job.id
    heartbeat = Heartbeat(ctx.sessions, settings, job_id, attempt)
    sinks = [TrainingMetrics(settings.worker_device),
             TensorBoardSink(tensorboard_dir(settings, job_id), hyperparameters)]
    reporter = JobReporter(ctx.sessions, settings, job_id, attempt, lost=heartbeat.lost, shutdown=ctx.shutdown,
                           storage=ctx.storage, sweep_id=sweep_id, sinks=sinks)
    config: EngineConfig | None = None
    try:
        with heartbeat:  # downloads and uploads count as the attempt's work: the reaper leaves it alone meanwhile
            config = _prepare(ctx, job, inputs)
            reporter.receipt = base_receipt(job, config)
            result = run_engine(ctx, job_id, attempt, config, reporter)
            if result.status == "completed" and result.model_dir is not None and not heartbeat.lost.is_set():
                push_model(ctx.storage, job_id, result.model_dir)
    except gang.GangIncomplete as exc:  # nothing ran: back in the queue, without counting as a lost attempt
        reporter.close()
        return _requeue(ctx, job_id, attempt, f"the other nodes did not gather ({exc}); back in the queue")
    except Exception as exc:  # noqa: BLE001 - any failure ends the job with a recorded reason
        log.exception("job %s failed", job_id)
        # Engines name a specific failure (oom, ...) with a `code` attribute on the exception.
        code = str(getattr(exc, "code", ErrorCode.TRAINING_ERROR))
        reporter.close()  # the event file complete before its artifact row is written
        if config is not None and config.nodes > 1 and code in RETRIED_ON_SEVERAL_NODES:
            return _node_lost(ctx, job_id, attempt, f"{type(exc).__name__}: {exc}")
        return _end(ctx, job_id, attempt, JobStatus.FAILED, f"{type(exc).__name__}: {exc}", code=code)
    finally:
        reporter.close()
        if config is not None:
            release_memory_of(config)
    if heartbeat.lost.is_set():
        log.warning("job %s attempt %d lost its claim; leaving the row to the newer attempt", job_id, attempt)
        return LOST
    try:
        reporter.flush()
        return _record_result(ctx, job_id, attempt, result)
    except StaleAttempt:
        log.warning("job %s attempt %d lost its claim before recording its result", job_id, attempt)
        return LOST


def run_engine(ctx: WorkerContext, job_id: str, attempt: int, config: EngineConfig, reporter: JobReporter
               ) -> TrainResult:
    """The engine for the job: in this process on one device, under torchrun (rank 0 reporting) on several, as the
    head of a gang of workers (worker.jobs.gang) on several nodes."""
    if config.nodes > 1:
        return lead(ctx, job_id, attempt, config, reporter)
    if config.devices > 1:
        return train_on_devices(config, reporter)
    return run(config, run_task(config), reporter)


def _prepare(ctx: WorkerContext, job: Job, inputs: JobInputs) -> EngineConfig:
    """Fetch the datasets and the newest stored checkpoint to this host, then build the engine's config."""
    with storage_errors(f"fetch the inputs of {job.id} from {ctx.storage.url}"):
        config = config_for(ctx.settings, ctx.storage, resolve_job(job), inputs, ctx.settings.worker_device)
    pull_checkpoint(ctx.storage, ctx.settings, job.id)
    return config


def release_memory_of(config: EngineConfig) -> None:
    """Give the device's cached memory back once a job ends, however it ended."""
    release_memory(resolve_device(config.device, config.precision, training=True))


def _claim(ctx: WorkerContext, session: Session, job_id: str) -> Job | None:
    now = utcnow()
    device = ctx.settings.worker_device
    named = session.get(Job, job_id) if is_valid_id(job_id) else None
    # The message came on its job's size queue: claim among jobs of that size, whichever's turn it is.
    job = job_order.claim_next(session, ctx.settings, device=device, now=now, devices=named.devices if named else 1)
    if job is not None:
        return job
    try:
        return states.claim_job(session, job_id=job_id, device=device, now=now, include_queued=False,
                               stale_before=now - timedelta(seconds=ctx.settings.heartbeat_timeout_s))
    except NotFound:
        log.warning("job %s does not exist; dropping its task", job_id)
        return None


def _end(ctx: WorkerContext, job_id: str, attempt: int, status: JobStatus, message: str,
         code: str | None = None) -> str:
    """Move the job to a terminal status if this attempt still holds it."""
    try:
        with session_scope(ctx.sessions) as session:
            _record_tensorboard(ctx, session, job_id, attempt)  # fenced: while the attempt still holds the job
            states.move(session, store.get_job(session, job_id=job_id), status, message=message, code=code,
                        attempt=attempt)
    except StaleAttempt:
        return LOST
    return status


def _requeue(ctx: WorkerContext, job_id: str, attempt: int, message: str) -> str:
    """Put the job back in the queue (with its outbox message) if this attempt still holds it."""
    try:
        with session_scope(ctx.sessions) as session:
            states.move(session, store.get_job(session, job_id=job_id), JobStatus.QUEUED, kind=EventKind.REQUEUED,
                        level="warning", attempt=attempt, message=message)
    except StaleAttempt:
        return LOST
    with ctx.sessions() as session:
        deliver_now(session, ctx.queue, job_id=job_id)
    return JobStatus.QUEUED


def _node_lost(ctx: WorkerContext, job_id: str, attempt: int, error: str) -> str:
    """A run on several nodes broke off: requeue it to resume from its last checkpoint, or fail it (node_lost) once
    it has had max_attempts attempts, as the reaper does for a lost worker."""
    log.warning("job %s attempt %d: a node was lost (%s)", job_id, attempt, error)
    if attempt >= ctx.settings.max_attempts:
        return _end(ctx, job_id, attempt, JobStatus.FAILED, code=ErrorCode.NODE_LOST,
                    message=f"a node was lost in each of {attempt} attempts; the last: {error}")
    return _requeue(ctx, job_id, attempt, f"a node was lost ({error}); requeued to resume from its last checkpoint")


def _record_result(ctx: WorkerContext, job_id: str, attempt: int, result: TrainResult) -> str:
    """Write the final metrics, the model artifact and the final status in one fenced transaction."""
    with session_scope(ctx.sessions) as session:
        store.fence(session, job_id=job_id, attempt=attempt)
        job = store.get_job(session, job_id=job_id)
        job.metrics = {**(job.metrics or {}), **result.metrics}
        job.step = result.global_step
        _record_tensorboard(ctx, session, job_id, attempt)
        if result.status == "completed" and result.model_dir is not None:
            kept = result.best
            job.best = None if not kept else BestEval(step=kept["step"], metric=kept["metric"], value=kept["value"])
            job.stop_reason = result.stop_reason
            # The model folder holds the best evaluation's weights: the artifact carries that step.
            model_step = kept["step"] if kept else result.global_step
            model = artifact_row(ctx.settings, job_id, ArtifactKind.MODEL, result.model_dir, model_step)
            store.add_artifact(session, artifact=model, attempt=attempt)
            how = {"completed": "finished"}.get(result.stop_reason or "completed", f"ended ({result.stop_reason})")
            best = f"; model from step {model_step}" if result.best else ""
            states.move(session, job, JobStatus.SUCCEEDED, attempt=attempt,
                        message=f"{how} after {result.global_step} steps{best}",
                        data={"stop_reason": result.stop_reason, "best": result.best})
        elif job.cancel_requested_at is None and ctx.shutdown.is_set():
            # The worker is stopping, not the user: checkpointed, so back to the queue (with its outbox message).
            states.move(session, job, JobStatus.QUEUED, kind=EventKind.PREEMPTED, attempt=attempt,
                        message=f"worker shut down at step {result.global_step}; requeued to resume")
        else:
            states.move(session, job, JobStatus.CANCELLED, attempt=attempt,
                        message=f"cancelled at step {result.global_step}")
        status = JobStatus(job.status)
    with ctx.sessions() as session:  # a requeue's message, or the wake-up for jobs a device limit held back
        deliver_now(session, ctx.queue)
    return status


def _record_tensorboard(ctx: WorkerContext, session: Session, job_id: str, attempt: int) -> None:
    """Record (or refresh) the job's TensorBoard folder as an artifact, downloadable like the model."""
    folder = tensorboard_dir(ctx.settings, job_id)
    files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
    if not files:
        return
    with storage_errors(f"upload the TensorBoard files of {job_id} to {ctx.storage.url}"):
        # Any one file serves as the marker: the folder is only ever read whole, after the job ended.
        marker = files[0].relative_to(folder).as_posix()
        ctx.storage.upload_dir(folder, relative_to_home(ctx.settings, folder), marker=marker)
    job = store.get_job(session, job_id=job_id)
    for old in [a for a in job.artifacts if a.kind == ArtifactKind.TENSORBOARD]:
        session.delete(old)
    store.add_artifact(session, artifact=artifact_row(ctx.settings, job_id, ArtifactKind.TENSORBOARD, folder, None),
                       attempt=attempt)
