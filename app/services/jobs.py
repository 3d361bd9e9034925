"""Fine-tuning jobs: validate, write the job with its outbox message, commit, then send; cancel; read history."""

from __future__ import annotations

import difflib
import logging
import math
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.schemas.jobs import ArtifactRead, BestRead, JobRead, Progress
from app.services import idempotency
from app.services.job_methods import is_chat, method_fields, require_table_data, resolve_base
from core import scheduler, states
from core.adapters import AdapterConfig
from core.admission import admit_jobs
from core.auth import Principal
from core.capacity import largest_device, live_workers
from core.chat_data import MAX_LENGTH as CHAT_MAX_LENGTH
from core.chat_data import longest_tokens
from core.errors import Conflict, NotFound, ValidationFailed
from core.estimate import (
    Head,
    adapter_parameter_count,
    architecture,
    format_bytes,
    load_model_config,
    training_memory,
)
from core.hyperparams import Hyperparameters, LMHyperparameters
from core.jobspec import CausalLMJob, ClassificationJob, JobSpec, kind_of
from core.lm_config import DEFAULT_BLOCK_SIZE, GPT2_VOCAB_SIZE, resolve_block_size, validate_model_config
from core.precision import auto_precision
from core.protocol import ErrorCode
from core.queue import TaskQueue
from core.relay import deliver_now
from core.rows import Dataset, EventKind, Job, JobStatus, new_id, utcnow
from core.settings import Settings
from core.store import datasets as dataset_store
from core.store import history
from core.store import jobs as store
from core.store.paging import decode_cursor, split_page
from core.tabular import MAX_LABEL_CHARS, MAX_TRACKED_VALUES, label_space, name_list, short, to_label

log = logging.getLogger(__name__)

ROUTE = "POST /jobs"
MAX_HINT_COLUMNS = 1000  # columns searched for a "did you mean" hint


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
            _require_column(dataset, spec.text_column, field)
            _require_text(dataset, spec.text_column, "train_dataset" if dataset is train else field)
    _require_devices(settings, spec.devices)
    base_path = resolve_base(session, settings, principal, spec)
    if isinstance(spec, CausalLMJob):
        fields = _causal_lm_fields(settings, spec, base_path, chat=is_chat(train),
                                   longest=longest_tokens(train.column_stats))
    elif isinstance(spec, ClassificationJob):
        fields = _classification_fields(settings, spec, train, evaluation, base_path)
    else:  # a kind with no checks of its own beyond its spec
        fields = {"base_model_path": None, "labels": []}
    fields.update(method_fields(spec, train, evaluation, fields.get("base_model_path")))
    _require_best_metric(spec, has_eval=evaluation is not None)
    fields["hyperparameters"] = spec.hyperparameters.model_dump(mode="json")  # the row keeps the typed model
    return Job(id=new_id("job"), tenant_id=principal.tenant_id, status=JobStatus.QUEUED, task=spec.task,
               base_model=spec.base_model, train_dataset_id=train.id, eval_dataset_id=spec.eval_dataset,
               text_column=spec.text_column, metadata_=spec.metadata, metrics={}, created_at=utcnow(),
               devices=spec.devices, priority=spec.priority, **fields)


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


def _classification_fields(settings: Settings, spec: ClassificationJob, train: Dataset, evaluation: Dataset | None,
                           base_path: str | None) -> dict[str, Any]:
    """Checks and resolved columns of a text-classification job."""
    if spec.architecture is not None:
        raise ValidationFailed("model_config", "model_config applies to causal-lm jobs only")
    if spec.base_model is None or base_path is None:
        raise ValidationFailed("base_model", "text-classification needs a base_model (e.g. minilm-l6)")
    hp = spec.hyperparameters
    if hp.max_length > settings.max_text_length:
        raise ValidationFailed("hyperparameters.max_length",
                               f"must be at most {settings.max_text_length} on this server")
    label_column = spec.label_column or "label"
    _require_column(train, label_column, "label_column")
    labels = _labels(train, label_column, "train_dataset")
    if len(labels) < 2:
        raise ValidationFailed("train_dataset", f"label column {label_column!r} has only one class "
                               f"({labels[0]!r}); classification needs at least two")
    if evaluation is not None:
        _require_column(evaluation, label_column, "eval_dataset")
        unseen = sorted(map(str, set(_labels(evaluation, label_column, "eval_dataset")) - set(labels)))
        if unseen:
            raise ValidationFailed("eval_dataset", f"labels not present in the training data: {unseen[:10]}")
    _require_fit(settings, load_model_config(base_path), "base_model", head="classifier", hp=hp,
                 seq_len=hp.max_length, num_labels=len(labels), devices=spec.devices, adapter=spec.adapter)
    return {"base_model_path": base_path, "label_column": label_column, "labels": labels}


def _causal_lm_fields(settings: Settings, spec: CausalLMJob, base_path: str | None, *, chat: bool = False,
                      longest: int | None = None) -> dict[str, Any]:
    """Checks of a causal-lm job: continue from a causal LM, or train a fresh GPT-2 of a given shape."""
    if spec.label_column is not None:
        raise ValidationFailed("label_column", "causal-lm jobs have no labels")
    hp = spec.hyperparameters
    if base_path is not None:
        if spec.architecture is not None:
            raise ValidationFailed("model_config", "give either base_model or model_config, not both")
        base_config = load_model_config(base_path) or {}
        context = base_config.get("max_position_embeddings") or base_config.get("n_positions")
        default_block = min(context, DEFAULT_BLOCK_SIZE) if isinstance(context, int) else DEFAULT_BLOCK_SIZE
        seq_len = hp.block_size or default_block
        if chat:
            # A batch is padded to its longest conversation, cut at block_size (chat_data.MAX_LENGTH by default):
            # the data's longest record, known since its validation, bounds it, and so does the model's context.
            seq_len = min(hp.block_size or CHAT_MAX_LENGTH, longest or CHAT_MAX_LENGTH,
                          context if isinstance(context, int) else CHAT_MAX_LENGTH)
        _require_fit(settings, base_config, "base_model", head="causal-lm", hp=hp, seq_len=seq_len,
                     devices=spec.devices, adapter=spec.adapter)
        return {"base_model_path": base_path, "labels": []}
    try:
        architecture = validate_model_config(spec.architecture or {})
    except ValueError as exc:
        field = str(exc).split(":", 1)[0].split(" ", 1)[0]
        raise ValidationFailed(field if field.startswith("model_config") else "model_config", str(exc)) from exc
    if hp.block_size is not None and hp.block_size > architecture["n_positions"]:
        raise ValidationFailed("hyperparameters.block_size",
                               f"must not exceed model_config.n_positions ({architecture['n_positions']})")
    _require_fit(settings, {**architecture, "vocab_size": GPT2_VOCAB_SIZE, "model_type": "gpt2"}, "model_config",
                 head="causal-lm", hp=hp, seq_len=resolve_block_size(hp.block_size, architecture["n_positions"]),
                 devices=spec.devices)
    return {"base_model_path": None, "model_config_": architecture, "labels": []}


def _require_devices(settings: Settings, devices: int) -> None:
    """Refuse (422 does_not_fit) a job asking for more devices than any live training worker owns."""
    if devices == 1:
        return
    workers = live_workers(settings.resolved_redis_url)
    if not workers:
        return  # none has reported yet (or Redis is unreadable): the job waits for a worker that owns enough
    most = max(workers, key=lambda w: w.devices)
    if devices > most.devices:
        raise ValidationFailed("devices", f"devices={devices}, but the live training workers own at most "
                               f"{most.devices} ({most.device} on {most.worker}); ask for at most {most.devices}",
                               code=ErrorCode.DOES_NOT_FIT)


def _require_fit(settings: Settings, model_config: dict[str, Any] | None, model_field: str, *, head: Head,
                 hp: Hyperparameters | LMHyperparameters, seq_len: int, num_labels: int = 2, devices: int = 1,
                 adapter: AdapterConfig | None = None) -> None:
    """Refuse (422 does_not_fit) a job whose estimated peak memory exceeds the largest device a live worker
    reported, or TRAINSERVE_ASSUMED_DEVICE_BYTES while none has; without a config to estimate from, admit."""
    arch = architecture(model_config) if model_config else None
    if arch is None:
        return  # e.g. a hub id not in the local cache: the worker estimates once it has the config
    device = largest_device(settings.resolved_redis_url, devices=devices)
    limit = device.total_bytes if device is not None else settings.assumed_device_bytes
    if not limit:
        return
    # The assumed device is a modern GPU; a CPU's bf16 calibration is the worker's to make (fp32 assumed here).
    precision: str = hp.precision
    if precision == "auto":
        precision = (auto_precision(is_cuda=True) if device is None else
                     auto_precision(is_cuda=device.is_cuda, bf16_supported=device.bf16))
    # GPUs run attention fused (no seq_len^2 scores); a CPU keeps the scores.
    # On N devices each one runs a share of every micro-batch (the job's batch_size is the global one).
    trainable = None if adapter is None else adapter_parameter_count(arch, adapter.r, adapter.target_modules, head,
                                                                     num_labels)
    estimate = training_memory(arch, head=head, batch_size=math.ceil(hp.batch_size / devices), seq_len=seq_len,
                               precision=precision, fused_attention=device is None or device.is_cuda,
                               num_labels=num_labels, trainable=trainable)
    if estimate.total_bytes <= limit:
        return
    where = (f"the largest device a live worker has reported ({device.device} on {device.worker}, "
             f"{format_bytes(limit)})" if device is not None else
             f"the {format_bytes(limit)} assumed while no live worker has reported its device "
             "(TRAINSERVE_ASSUMED_DEVICE_BYTES)")
    if estimate.fixed_bytes > limit:
        field, hint = model_field, "use a smaller model"
    else:
        field, hint = "hyperparameters.batch_size", ("lower batch_size (and raise gradient_accumulation_steps for "
                                                     "the same effective batch) or the sequence length")
    raise ValidationFailed(field, f"this job needs about {estimate.describe()}, more than {where}; {hint}",
                           code=ErrorCode.DOES_NOT_FIT)


def _dataset(session: Session, principal: Principal, dataset_id: str, field: str) -> Dataset:
    try:
        return dataset_store.get_dataset(session, dataset_id=dataset_id, tenant=principal.scope)
    except NotFound as exc:
        raise ValidationFailed(field, f"dataset {dataset_id!r} does not exist") from exc


def _require_column(dataset: Dataset, column: str, field: str) -> None:
    if column in dataset.columns:
        return
    # Bounded work and a bounded message, even for rows stored before datasets had a column limit.
    candidates = dataset.columns[:MAX_HINT_COLUMNS]
    close = difflib.get_close_matches(column, candidates, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValidationFailed(field, f"column {short(column)} is not in dataset {dataset.id} "
                           f"(columns: {name_list(dataset.columns)}){hint}")


def _labels(dataset: Dataset, column: str, field: str) -> list[int | str]:
    stats = dataset.column_stats.get(column, {})
    if stats.get("empty"):
        raise ValidationFailed(field, f"{stats['empty']} rows have an empty {short(column)} label")
    values = stats.get("values")
    if values is None:
        raise ValidationFailed(field, f"column {short(column)} has over {MAX_TRACKED_VALUES} distinct values or "
                               f"values over {MAX_LABEL_CHARS} characters; is it the label?")
    # Stats keys are strings; numeric labels come back as ints, as the worker reads them, so the maps agree.
    return label_space([to_label(v) for v in values])


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
    return job_read(job, best, placement=scheduler.place(session, settings, job, now=utcnow()))


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
    `placement`: queue position and reason, from core.scheduler)."""
    total = job.total_steps
    fraction = 1.0 if job.status == JobStatus.SUCCEEDED else (min(job.step / total, 1.0) if total else 0.0)
    return JobRead(
        id=job.id, status=job.status, task=job.task, base_model=job.base_model,  # type: ignore[arg-type]
        architecture=job.model_config_,
        train_dataset=job.train_dataset_id, eval_dataset=job.eval_dataset_id,
        text_column=job.text_column, label_column=job.label_column, labels=job.labels,
        hyperparameters=job.hyperparameters, adapter=job.adapter, method=job.method, devices=job.devices,
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
