"""/v1/fine_tuning/jobs over trainserve's jobs: the same job (same id) under /jobs and under OpenAI's API.

A request maps onto one job spec: `model` is base_model, the files are datasets, `method` supervised is sft, dpo is
dpo and reinforcement is reinforcement (the last two with the default LoRA adapter unless one is given: their
reference model is the base with the adapter off; a reinforcement job's grader is validated with the spec). "auto"
leaves trainserve's default of the job's kind; learning_rate_multiplier scales the default learning rate. A
validation error names OpenAI's field (training_file, method.dpo.hyperparameters.n_epochs...). A succeeded job's
`fine_tuned_model` is its id: the name /v1/chat/completions and /v1/completions serve it by.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy.orm import Session

from app.schemas.fine_tuning import (
    FineTuningJob,
    FineTuningJobCreate,
    FineTuningJobEvent,
    FineTuningJobEventList,
    FineTuningJobList,
    HyperparametersRead,
    JobError,
    MethodHyperparameters,
    MethodRead,
    ReinforcementHyperparameters,
    ReinforcementMethod,
    ReinforcementRead,
    SupervisedHyperparameters,
)
from app.services import evals, jobs
from app.services.files import unix
from core.adapters import AdapterConfig, PreferenceConfig
from core.auth import Principal
from core.errors import NotFound, ValidationFailed
from core.hyperparams import default
from core.jobspec import KINDS, kind_of, kinds_where, validate_spec
from core.queue import TaskQueue
from core.reinforcement import ReinforcementConfig
from core.rows import EventKind, Job, JobEvent, JobStatus, utcnow
from core.settings import Settings
from core.storage import ArtifactStore
from core.store import jobs as store
from core.store.paging import cursor_of

ROUTE = "POST /v1/fine_tuning/jobs"
SPEC_FIELDS = {"train_dataset": "training_file", "eval_dataset": "validation_file", "base_model": "model",
               "method.beta": "method.dpo.hyperparameters.beta", "method": "method.type"}
EVENT_ID = re.compile(r"^ftevent-([0-9]{1,10})$")
LEVELS = {"warning": "warn", "warn": "warn", "error": "error"}
METHODS = {"supervised": "sft", "dpo": "dpo", "reinforcement": "reinforcement"}  # OpenAI's -> the spec's method
REINFORCEMENT_SAMPLES = default(ReinforcementConfig, "samples")


def create_job(session: Session, settings: Settings, storage: ArtifactStore, queue: TaskQueue,
               principal: Principal, *, body: FineTuningJobCreate, idempotency_key: str | None) -> Job:
    """Map the request onto a job spec and create the job as POST /jobs does; errors name OpenAI's fields."""
    spec_body, names, where = job_spec(body)
    try:
        spec = validate_spec(spec_body)
        runs = evals.job_runs(session, settings, storage, principal, job=body.eval, base_model=body.model,
                              task=body.task)
        job = jobs.create_job(session, settings, queue, principal, spec=spec, idempotency_key=idempotency_key,
                              route=ROUTE, suffix=body.suffix)
    except ValidationFailed as exc:
        raise renamed(exc, names, where) from exc
    if runs is not None:
        evals.start_job_runs(session, settings, storage, queue, job_id=job.id, runs=runs)
    return job


def job_spec(body: FineTuningJobCreate) -> tuple[dict[str, Any], dict[str, str], str]:
    """The job spec a request stands for, the OpenAI name of each hyperparameter it set, and where they are."""
    method, chosen = body.method, None
    if method is not None and body.hyperparameters is not None:
        raise ValidationFailed("hyperparameters", "give the hyperparameters in method, not both")
    if method is not None:
        chosen = getattr(method, method.type)
        for other in METHODS:
            if other != method.type and getattr(method, other) is not None:
                raise ValidationFailed(f"method.{other}", f"method.type is {method.type}; give method.{method.type}")
        if chosen is None and method.type == "reinforcement":
            raise ValidationFailed("method.reinforcement", "method reinforcement needs method.reinforcement.grader")
    method_type = method.type if method is not None else "supervised"
    hp: SupervisedHyperparameters = (chosen.hyperparameters if chosen is not None
                                     else body.hyperparameters or SupervisedHyperparameters())
    where = f"method.{method_type}.hyperparameters" if method is not None else "hyperparameters"
    reinforcement = _reinforcement(chosen, where) if isinstance(chosen, ReinforcementMethod) else None
    values, names = _hyperparameters(body.task, hp, where, exclude=set(reinforcement or {}))
    if isinstance(hp, ReinforcementHyperparameters):
        if hp.eval_interval != "auto":
            values["eval_steps"], names["eval_steps"] = hp.eval_interval, "eval_interval"
        if hp.compute_multiplier != "auto":  # the samples it asks for are the client's compute_multiplier
            names["samples"] = "compute_multiplier"
        values.setdefault("metric_for_best", "eval_reward")
    if body.seed is not None:
        values["seed"] = body.seed
        names["seed"] = "seed"
    spec: dict[str, Any] = {"task": body.task, "base_model": body.model, "train_dataset": body.training_file,
                            "eval_dataset": body.validation_file, "hyperparameters": values,
                            "metadata": body.metadata or {}, "devices": body.devices, "priority": body.priority}
    for name in ("text_column", "label_column"):
        if getattr(body, name) is not None:
            spec[name] = getattr(body, name)
    adapter = body.adapter
    method_name = METHODS[method_type]
    methods = kind_of(body.task).methods  # none: the kind trains one way, which is supervised
    if method_name not in (methods or (METHODS["supervised"],)):
        raise ValidationFailed("method.type", f"method {method_type} trains "
                               f"{kinds_where(lambda kind: method_name in kind.methods)} jobs (task)")
    if methods:
        spec["method"] = {"method": method_name}
    if method_name == "dpo":
        beta = getattr(hp, "beta", "auto")
        spec["method"].update({} if beta == "auto" else {"beta": beta})
    if reinforcement is not None:
        spec["method"].update(reinforcement)
    if method_name in ("dpo", "reinforcement"):
        adapter = adapter or AdapterConfig()
    if adapter is not None:
        spec["adapter"] = adapter.model_dump(mode="json")
    return spec, names, where


def _reinforcement(chosen: ReinforcementMethod, where: str) -> dict[str, Any]:
    """The spec's reinforcement method fields: the grader, OpenAI's sampling settings, GRPO's own given by name."""
    hp = chosen.hyperparameters
    if hp.reasoning_effort not in (None, "default"):
        raise ValidationFailed(f"{where}.reasoning_effort", "reasoning_effort: trainserve's models have no "
                                                            "reasoning effort; bound answers with "
                                                            "max_completion_tokens")
    own = set(ReinforcementConfig.model_fields) - {"method", "grader"}
    fields: dict[str, Any] = {"grader": chosen.grader}
    fields.update({name: value for name, value in (hp.model_extra or {}).items() if name in own})
    if hp.compute_multiplier != "auto":
        if "samples" in fields:
            raise ValidationFailed(f"{where}.compute_multiplier", "give compute_multiplier or samples, not both")
        fields["samples"] = max(2, round(REINFORCEMENT_SAMPLES * float(hp.compute_multiplier)))
    if hp.eval_samples != "auto":
        fields["eval_samples"] = hp.eval_samples
    return fields


def _hyperparameters(task: str, hp: SupervisedHyperparameters, where: str,
                     exclude: set[str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """trainserve's hyperparameters from OpenAI's ("auto": left to the default) and trainserve's own names (but
    those in `exclude`: a method's own)."""
    values: dict[str, Any] = {name: value for name, value in (hp.model_extra or {}).items()
                              if name not in (exclude or set())}
    names = {name: name for name in values}
    model = kind_of(task).hyperparameters
    for ours, theirs, value in (("epochs", "n_epochs", hp.n_epochs), ("batch_size", "batch_size", hp.batch_size),
                                ("learning_rate", "learning_rate_multiplier", hp.learning_rate_multiplier)):
        if value == "auto":
            continue
        if ours in values and ours != theirs:
            raise ValidationFailed(f"{where}.{theirs}", f"give {theirs} or {ours}, not both")
        if ours == "learning_rate":
            if "learning_rate" not in model.model_fields:
                raise ValidationFailed(f"{where}.{theirs}", f"{task} jobs have no learning rate to scale")
            value = default(model, "learning_rate") * float(value)
        values[ours], names[ours] = value, theirs
    return values, names


def renamed(exc: ValidationFailed, names: dict[str, str], where: str) -> ValidationFailed:
    """The error with OpenAI's name of the field at fault (its message too)."""
    field = exc.field
    if field is None:
        return exc
    if field in SPEC_FIELDS:
        new = SPEC_FIELDS[field]
    elif field.startswith("method.reinforcement"):  # the spec's method union tags its member
        rest = field.removeprefix("method.reinforcement").lstrip(".")
        # The method's own check (the grader runs in the training process) has no location below the method.
        new = (f"method.reinforcement.{rest or 'grader'}" if not rest or rest.startswith("grader")
               else f"{where}.{names.get(rest, rest)}")
    elif field.startswith("hyperparameters."):
        name = field.split(".", 1)[1]
        new = "seed" if names.get(name) == "seed" else f"{where}.{names.get(name, name)}"
    else:
        return exc
    return ValidationFailed(new, exc.message.replace(field, new), code=exc.code, details=exc.details)


def read_jobs(session: Session, jobs: list[Job]) -> list[FineTuningJob]:
    """Jobs as OpenAI's objects (one query for what their engines reported when they started)."""
    started = store.started_data(session, job_ids=[j.id for j in jobs if j.status == JobStatus.SUCCEEDED])
    return [fine_tuning_job(job, started.get(job.id)) for job in jobs]


def read_job(session: Session, job: Job) -> FineTuningJob:
    """One job as OpenAI's object."""
    return read_jobs(session, [job])[0]


def fine_tuning_job(job: Job, started: dict[str, Any] | None = None) -> FineTuningJob:
    """A job as OpenAI's fine_tuning.job: statuses, resolved hyperparameters, fine_tuned_model once succeeded;
    `started`: its engine's report at the start (a chat job's tokens per epoch)."""
    hp = job.hyperparameters or {}
    method = job.method
    method_type = ("dpo" if isinstance(method, PreferenceConfig) else
                   "reinforcement" if isinstance(method, ReinforcementConfig) else "supervised")
    resolved = HyperparametersRead(batch_size=hp.get("batch_size"), learning_rate_multiplier=_multiplier(job),
                                   n_epochs=hp.get("epochs"),
                                   beta=method.beta if isinstance(method, PreferenceConfig | ReinforcementConfig)
                                   else None)
    if isinstance(method, ReinforcementConfig):
        resolved = resolved.model_copy(update={
            "compute_multiplier": round(method.samples / REINFORCEMENT_SAMPLES, 6),
            "eval_interval": hp.get("eval_steps"), "eval_samples": method.eval_samples})
        method_read = MethodRead(type="reinforcement", reinforcement=ReinforcementRead(
            hyperparameters=resolved, grader=method.model_dump(mode="json")["grader"]))
    else:
        method_read = MethodRead(type=method_type,  # type: ignore[arg-type]
                                 **{method_type: MethodHyperparameters(hyperparameters=resolved)})
    error = job.error or None
    running_eta = job.status == JobStatus.RUNNING and job.eta_seconds is not None
    return FineTuningJob(
        id=job.id, created_at=unix(job.created_at) or 0, finished_at=unix(job.finished_at),
        error=JobError(code=str(error.get("code") or "error"), message=str(error.get("message") or ""),
                       param=error.get("field")) if error else None,
        fine_tuned_model=job.id if job.status == JobStatus.SUCCEEDED else None,
        hyperparameters=resolved, model=job.base_model or "gpt2", organization_id=job.tenant_id,
        seed=int(hp.get("seed", 0)), status=job.status,  # type: ignore[arg-type]
        trained_tokens=_trained_tokens(job, started or {}), training_file=job.train_dataset_id,
        validation_file=job.eval_dataset_id,
        estimated_finish=int((job.heartbeat_at or utcnow()).timestamp() + job.eta_seconds)  # type: ignore[operator]
        if running_eta else None,
        metadata={str(k): str(v) for k, v in job.metadata_.items()} if job.metadata_ else None,
        method=method_read,
        user_provided_suffix=job.suffix)


def _multiplier(job: Job) -> float | None:
    """The learning rate as a multiple of the default of the job's kind."""
    kind = KINDS.get(job.task)
    rate = (job.hyperparameters or {}).get("learning_rate")
    if kind is None or rate is None or "learning_rate" not in kind.hyperparameters.model_fields:
        return None
    return round(float(rate) / default(kind.hyperparameters, "learning_rate"), 6)


def _trained_tokens(job: Job, started: dict[str, Any]) -> int | None:
    """Tokens the training steps put through the model, once the job succeeded: a text corpus's throughput times
    its time, a chat job's tokens per epoch times its epochs."""
    metrics = job.metrics or {}
    rate, runtime = metrics.get("train_tokens_per_second"), metrics.get("train_runtime")
    per_epoch = started.get("train_tokens_per_epoch")
    if job.status != JobStatus.SUCCEEDED:
        return None
    if rate is not None and runtime is not None:
        return round(rate * runtime)
    if isinstance(per_epoch, (int, float)):
        return round(per_epoch * job.epoch)
    return None


def list_jobs(session: Session, principal: Principal, *, after: str | None, limit: int) -> FineTuningJobList:
    """Jobs newest first; `after` is the id of the previous page's last job."""
    cursor = cursor_of(_job(session, principal, after, field="after")) if after else None
    rows = store.list_jobs(session, limit=limit + 1, tenant=principal.scope, after=cursor)
    return FineTuningJobList.of(read_jobs(session, rows[:limit]), has_more=len(rows) > limit)


def _job(session: Session, principal: Principal, job_id: str, *, field: str | None = None) -> Job:
    try:
        return store.get_job(session, job_id=job_id, tenant=principal.scope)
    except NotFound as exc:
        raise NotFound(f"fine-tuning job {job_id!r} not found", field=field) from exc


def get_job(session: Session, principal: Principal, *, job_id: str) -> Job:
    """One of the caller's jobs (404 in OpenAI's error shape otherwise)."""
    return _job(session, principal, job_id)


def event_read(event: JobEvent) -> FineTuningJobEvent:
    """A job event as OpenAI's: evaluations are `metrics` events."""
    return FineTuningJobEvent(id=f"ftevent-{event.id}", created_at=unix(event.created_at) or 0,
                              level=LEVELS.get(event.level, "info"), message=event.message,  # type: ignore[arg-type]
                              data=event.data, type="metrics" if event.kind == EventKind.EVAL else "message")


def list_events(session: Session, principal: Principal, *, job_id: str, after: str | None,
                limit: int) -> FineTuningJobEventList:
    """A job's events newest first (OpenAI's order); `after` is the id of the previous page's last event."""
    _job(session, principal, job_id)
    before = None
    if after is not None:
        match = EVENT_ID.match(after)
        if match is None:
            raise ValidationFailed("after", "after is an event id (ftevent-<number>) from an earlier page")
        before = int(match.group(1))
    rows = store.list_events_newest_first(session, job_id=job_id, before_id=before, limit=limit + 1)
    return FineTuningJobEventList.of([event_read(e) for e in rows[:limit]], has_more=len(rows) > limit)
