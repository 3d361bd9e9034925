"""Fine-tuning jobs: validate, write the job with its outbox message, commit, then send; cancel; read history."""

from __future__ import annotations

import logging

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.schemas.jobs import ArtifactRead, BestRead, JobRead, Progress
from app.services import idempotency
from app.services.job_kinds import kind_fields, require_column
from app.services.job_methods import is_chat, method_fields, require_quantizable, require_table_data, resolve_base
from core import job_order, states
from core.admission import admit_jobs
from core.auth import Principal
from core.capacity import live_workers
from core.errors import Conflict, NotFound, ValidationFailed
from core.jobspec import JobSpec, kind_of
from core.protocol import ErrorCode
from core.queue import TaskQueue
from core.relay import deliver_now
from core.rows import Dataset, EventKind, Job, JobStatus, new_id, utcnow
from core.settings import Settings
from core.store import datasets as dataset_store
from core.store import history
from core.store import jobs as store
from core.store.paging import decode_cursor, split_page
from core.tabular import short

log = logging.getLogger(__name__)

ROUTE = "POST /jobs"


def create_job(session: Session, settings: Settings, queue: TaskQueue, principal: Principal, *, spec: JobSpec,
               idempotency_key: str | None = None, route: str = ROUTE, rerun_of: str | None = None,
               suffix: str | None = None) -> Job:
    """Validate a fine-tune request against its datasets, store the job and its task message, then send it.

    The message commits with the row: if the broker refuses, the job stays queued and the outbox relay
    sends it once the broker is back. `suffix`: /v1/fine_tuning/jobs' name part, kept on the row.
    """
    body = spec.request()
    extra = {name: value for name, value in (("rerun_of", rerun_of), ("suffix", suffix)) if value}
    request_hash = idempotency.fingerprint({**body, **extra} if extra else body)
    replayed = idempotency.replayed_id(session, principal, route=route, key=idempotency_key,
                                       request_hash=request_hash)
    if replayed is not None:
        return store.get_job(session, job_id=replayed)
    job = prepare_job(session, settings, principal, spec=spec)
    job.rerun_of, job.suffix = rerun_of, suffix
    admit_jobs(session, settings, tenant_id=principal.tenant_id)  # the tenant stays locked until the commit
    try:
        states.create(session, job)  # the row, its `created` event and its outbox message
        idempotency.remember(session, principal, route=route, key=idempotency_key, request_hash=request_hash,
                             resource_id=job.id)
        session.commit()
        log.info("job %s created (%s, %s)", job.id, job.task, job.base_model or "fresh model", extra={"job_id": job.id})
    except IntegrityError:
        # A concurrent request with the same Idempotency-Key committed first: answer with its job.
        session.rollback()
        replayed = idempotency.replayed_id(session, principal, route=route, key=idempotency_key,
                                           request_hash=request_hash)
        if replayed is not None:
            return store.get_job(session, job_id=replayed)
        # Or a dataset was deleted after it was checked (the foreign key refused the job): say which one.
        for dataset_id, field in ((spec.train_dataset, "train_dataset"), (spec.eval_dataset, "eval_dataset")):
            try:
                if dataset_id:
                    dataset_store.get_dataset(session, dataset_id=dataset_id)
            except NotFound:
                raise Conflict(f"dataset {dataset_id!r} was deleted while the job was being created",
                               field=field) from None
        raise
    deliver_now(session, queue, job_id=job.id)
    return job


def prepare_job(session: Session, settings: Settings, principal: Principal, *, spec: JobSpec) -> Job:
    """Validate a request against its datasets and the server's limits; the new (unsaved) queued job."""
    train = _dataset(session, principal, spec.train_dataset, "train_dataset")
    evaluation = _dataset(session, principal, spec.eval_dataset, "eval_dataset") if spec.eval_dataset else None
    require_table_data(spec, train, evaluation)
    for field, dataset in (("text_column", train), ("eval_dataset", evaluation)):
        if dataset is not None and not is_chat(dataset):  # chat records are rendered, they have no text column
            require_column(dataset, spec.text_column, field)
            _require_text(dataset, spec.text_column, "train_dataset" if dataset is train else field)
    _require_devices(settings, spec.devices, spec.nodes)
    require_quantizable(spec)  # before the estimate, which counts a 4-bit base
    base_path = resolve_base(session, settings, principal, spec)
    fields = kind_fields(settings, spec, train, evaluation, base_path)  # the checks the job's kind registered
    fields.update(method_fields(spec, train, evaluation, fields.get("base_model_path")))
    _require_best_metric(spec, has_eval=evaluation is not None)
    fields["hyperparameters"] = spec.hyperparameters.model_dump(mode="json")  # the row keeps the typed model
    return Job(id=new_id("job"), tenant_id=principal.tenant_id, status=JobStatus.QUEUED, task=spec.task,
               base_model=spec.base_model, train_dataset_id=train.id, eval_dataset_id=spec.eval_dataset,
               text_column=spec.text_column, metadata_=spec.metadata, metrics={}, created_at=utcnow(),
               devices=spec.devices, nodes=spec.nodes, priority=spec.priority, **fields)


def _require_best_metric(spec: JobSpec, *, has_eval: bool) -> None:
    """metric_for_best must be one the task kind reports; early stopping needs evaluations during the run."""
    hp = spec.hyperparameters
    reported = kind_of(spec.task).metrics
    if hp.metric_for_best not in reported:
        raise ValidationFailed("hyperparameters.metric_for_best",
                               f"{spec.task} jobs report {', '.join(reported)}; got {short(hp.metric_for_best)}")
    if hp.early_stopping_patience is None:
        return
    if hp.eval_steps is None:
        raise ValidationFailed("hyperparameters.eval_steps",
                               "early_stopping_patience needs eval_steps: evaluations during the run")
    if not kind_of(spec.task).holds_out_eval and not has_eval:
        raise ValidationFailed("eval_dataset", "early_stopping_patience needs an eval_dataset to evaluate on")


def _require_devices(settings: Settings, devices: int, nodes: int = 1) -> None:
    """Refuse (422 does_not_fit) a job asking for more devices than any live training worker owns, or for more
    nodes than there are live training workers owning `devices`."""
    if devices == 1 and nodes == 1:
        return
    workers = live_workers(settings.resolved_redis_url)
    if not workers:
        return  # none has reported yet (or Redis is unreadable): the job waits for workers that own enough
    most = max(workers, key=lambda w: w.devices)
    if devices > most.devices:
        raise ValidationFailed("devices", f"devices={devices}, but the live training workers own at most "
                               f"{most.devices} ({most.device} on {most.worker}); ask for at most {most.devices}",
                               code=ErrorCode.DOES_NOT_FIT)
    enough = sum(1 for w in workers if w.devices >= devices)
    if nodes > enough:
        raise ValidationFailed("nodes", f"nodes={nodes}, but {enough} live training worker"
                               f"{'s own' if enough != 1 else ' owns'} {devices} or more devices; ask for at most "
                               f"{enough}", code=ErrorCode.DOES_NOT_FIT)


def _dataset(session: Session, principal: Principal, dataset_id: str, field: str) -> Dataset:
    try:
        return dataset_store.get_dataset(session, dataset_id=dataset_id, tenant=principal.scope)
    except NotFound as exc:
        raise ValidationFailed(field, f"dataset {dataset_id!r} does not exist") from exc


def _require_text(dataset: Dataset, column: str, field: str) -> None:
    empty = dataset.column_stats.get(column, {}).get("empty", 0)
    if empty:
        raise ValidationFailed(field, f"{empty} rows have an empty {short(column)} text")


def get_job(session: Session, principal: Principal, *, job_id: str) -> Job:
    """One job by id."""
    return store.get_job(session, job_id=job_id, tenant=principal.scope)


def read_jobs(session: Session, jobs: list[Job]) -> list[JobRead]:
    """Public job objects with their best evaluation metrics (one query for all of them)."""
    best = history.best_metrics(session, job_ids=[j.id for j in jobs])
    return [job_read(j, best.get(j.id)) for j in jobs]


def job_detail(session: Session, settings: Settings, job: Job) -> JobRead:
    """The job object with its best evaluation metrics and, while it is queued, its place in the queue and why."""
    best = history.best_metrics(session, job_ids=[job.id]).get(job.id)
    return job_read(job, best, placement=job_order.place(session, settings, job, now=utcnow()))


def list_jobs(session: Session, principal: Principal, *, limit: int, status: str | None, cursor: str | None
              ) -> tuple[list[Job], str | None]:
    """A page of jobs and the cursor of the next one."""
    after = decode_cursor(cursor) if cursor else None
    rows = store.list_jobs(session, limit=limit + 1, tenant=principal.scope, status=status, after=after)
    return split_page(rows, limit)


def cancel_job(session: Session, queue: TaskQueue, principal: Principal, *, job_id: str) -> Job:
    """Cancel a queued job at once; ask a running one to stop after its current step."""
    job = store.get_job(session, job_id=job_id, tenant=principal.scope, for_update=True)
    if job.is_terminal:
        raise Conflict(f"job {job_id!r} has already {job.status}; only queued or running jobs can be cancelled",
                       field="status")
    request_cancel(session, job)
    session.commit()
    if job.status == JobStatus.CANCELLED and job.task_id:
        queue.revoke(job.task_id)
    return job


def request_cancel(session: Session, job: Job, *, why: str = "") -> None:
    """Cancel a queued job now, or flag a running one to stop after its step; the caller commits and revokes."""
    now = utcnow()
    job.cancel_requested_at = job.cancel_requested_at or now
    if job.status == JobStatus.QUEUED:
        states.move(session, job, JobStatus.CANCELLED, message=f"cancelled before it started{why}", now=now)
    else:
        store.add_event(session, job_id=job.id, kind=EventKind.CANCEL_REQUESTED,
                        message=f"cancel requested{why}; the worker stops after the current step")


def job_read(job: Job, best: dict[str, float] | None = None, *, placement: tuple[int, str] | None = None
             ) -> JobRead:
    """Build the public job object from a row (with the best evaluation metrics when the caller read them;
    `placement`: queue position and reason, from core.job_order)."""
    total = job.total_steps
    fraction = 1.0 if job.status == JobStatus.SUCCEEDED else (min(job.step / total, 1.0) if total else 0.0)
    return JobRead(
        id=job.id, status=job.status, task=job.task, base_model=job.base_model,  # type: ignore[arg-type]
        architecture=job.model_config_,
        train_dataset=job.train_dataset_id, eval_dataset=job.eval_dataset_id,
        text_column=job.text_column, label_column=job.label_column, labels=job.labels,
        hyperparameters=job.hyperparameters, adapter=job.adapter, method=job.method, devices=job.devices,
        nodes=job.nodes,
        progress=Progress(step=job.step, total_steps=total, epoch=round(job.epoch, 4), fraction=round(fraction, 4)),
        eta_seconds=None if job.is_terminal else job.eta_seconds,
        metrics=job.metrics or {}, best_metrics=best or {}, device=job.device, error=job.error, attempts=job.attempts,
        cancel_requested=job.cancel_requested_at is not None,
        best=BestRead(**job.best) if job.best else None, stop_reason=job.stop_reason, sweep_id=job.sweep_id,
        artifacts=[ArtifactRead(id=a.id, kind=a.kind, step=a.step, size_bytes=a.size_bytes, files=a.files,
                                created_at=a.created_at,
                                download_url=f"/jobs/{job.id}/artifacts/{a.id}/download")
                   for a in job.artifacts],
        created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
        metadata=job.metadata_ or {}, priority=job.priority, receipt=job.receipt, rerun_of=job.rerun_of,
        queue_position=placement[0] if placement else None, waiting_reason=placement[1] if placement else None,
    )
