"""Sweeps: expand the search space into fixed trials, validate each as a job, store the sweep with its first
children (and their outbox messages) in one transaction, then send; read, list and cancel."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.schemas.jobs import BestRead
from app.schemas.sweeps import ParameterSpec, PruningSpec, SweepBest, SweepCreate, SweepRead, SweepTrialRead
from app.services import idempotency
from app.services.jobs import prepare_job, request_cancel
from core.admission import waiting_reason
from core.auth import Principal
from core.columns import SweepTemplate
from core.errors import Conflict, TooManyRequests, ValidationFailed
from core.jobspec import kind_of, validate_spec
from core.protocol import ErrorCode
from core.queue import TaskQueue
from core.relay import deliver_now
from core.rows import ACTIVE, Job, Sweep, SweepStatus, new_id, utcnow
from core.settings import Settings
from core.store import jobs as job_store
from core.store import sweeps as store
from core.store.paging import decode_cursor, split_page
from core.sweeps import advance, best_child, format_params

ROUTE = "POST /sweeps"


def sweep_template(job: Job) -> SweepTemplate:
    """The validated job columns every child of a sweep shares (its first trial's); a trial changes only the
    hyperparameters."""
    return SweepTemplate(task=job.task, base_model=job.base_model, base_model_path=job.base_model_path,
                         train_dataset_id=job.train_dataset_id, eval_dataset_id=job.eval_dataset_id,
                         text_column=job.text_column, label_column=job.label_column, labels=job.labels,
                         model_config_=job.model_config_, metadata_=job.metadata_, devices=job.devices, nodes=job.nodes,
                         adapter=job.adapter, method=job.method)


def expand_trials(spec: SweepCreate, max_trials: int) -> list[dict[str, Any]]:
    """The trials' parameter values: the grid's product, or `count` seeded draws (fixed at creation)."""
    names = sorted(spec.parameters)
    if spec.method == "grid":
        if spec.count is not None:
            raise ValidationFailed("count", "count applies to random sweeps; a grid runs every combination")
        for name in names:
            if spec.parameters[name].values is None:
                raise ValidationFailed(f"parameters.{name}", "a grid takes values, not a range")
        total = math.prod(len(spec.parameters[n].values or []) for n in names)
        if total > max_trials:
            raise ValidationFailed("parameters", f"the grid has {total} combinations; at most {max_trials}")
        grid = itertools.product(*(spec.parameters[n].values or [] for n in names))
        return [dict(zip(names, combo, strict=True)) for combo in grid]
    if spec.count is None:
        raise ValidationFailed("count", "a random sweep needs count")
    if spec.count > max_trials:
        raise ValidationFailed("count", f"at most {max_trials} trials")
    rng = random.Random(spec.seed)
    return [{name: _draw(spec.parameters[name], rng) for name in names} for _ in range(spec.count)]


def _draw(space: ParameterSpec, rng: random.Random) -> Any:
    if space.values is not None:
        return rng.choice(space.values)
    low, high = space.low, space.high
    assert low is not None and high is not None  # the schema checked the range
    if isinstance(low, int) and isinstance(high, int) and not space.log:
        return rng.randint(low, high)
    value = math.exp(rng.uniform(math.log(low), math.log(high))) if space.log else rng.uniform(low, high)
    if isinstance(low, int) and isinstance(high, int):
        return min(max(round(value), low), high)
    return value


def create_sweep(session: Session, settings: Settings, queue: TaskQueue, principal: Principal, *,
                 spec: SweepCreate, idempotency_key: str | None = None) -> Sweep:
    """Validate every trial as a job, store the sweep and its first children, commit, then send."""
    request_hash = idempotency.fingerprint(spec.model_dump(mode="json"))
    replayed = idempotency.replayed_id(session, principal, route=ROUTE, key=idempotency_key,
                                       request_hash=request_hash)
    if replayed is not None:
        return store.get_sweep(session, sweep_id=replayed)
    if "metric_for_best" in spec.parameters:
        raise ValidationFailed("parameters.metric_for_best", "a sweep compares its children by one metric; set "
                                                             "it in job.hyperparameters")
    trial_params = expand_trials(spec, settings.max_sweep_trials)
    jobs = [_trial_job(session, settings, principal, spec, index, params) for index, params in enumerate(trial_params)]
    first = jobs[0]
    metric = first.hyperparameters["metric_for_best"]
    if not kind_of(first.task).holds_out_eval and first.eval_dataset_id is None:
        raise ValidationFailed("job.eval_dataset", f"a sweep compares children by {metric}: give an eval_dataset")
    if spec.pruning is not None and any(job.hyperparameters["eval_steps"] is None for job in jobs):
        raise ValidationFailed("job.hyperparameters.eval_steps",
                               "pruning compares children at their evaluations: set eval_steps")
    sweep = Sweep(id=new_id("swp"), tenant_id=principal.tenant_id, status=SweepStatus.RUNNING, method=spec.method,
                  parameters={k: v.model_dump(exclude_defaults=True) for k, v in spec.parameters.items()},
                  job_spec=spec.job.request(),
                  template=sweep_template(first),
                  trials=[{"params": params, "hyperparameters": job.hyperparameters}
                          for params, job in zip(trial_params, jobs, strict=True)],
                  parallelism=spec.parallelism, metric=metric,
                  greater_is_better=kind_of(first.task).greater_is_better(metric),
                  pruning=spec.pruning.model_dump() if spec.pruning else None, created_at=utcnow())
    try:
        session.add(sweep)
        session.flush()
        created = advance(session, settings, sweep_id=sweep.id)  # the first children (as many as the quota allows)
        if not created:  # the tenant is at its job limit: nothing could start, so the sweep is refused
            raise TooManyRequests(f"the tenant has {settings.max_active_jobs_per_tenant} jobs queued or running, "
                                  "its limit; a sweep needs room for its first child", retry_after=30,
                                  code=ErrorCode.QUOTA_EXCEEDED)
        idempotency.remember(session, principal, route=ROUTE, key=idempotency_key, request_hash=request_hash,
                             resource_id=sweep.id)
        session.commit()
    except IntegrityError:
        session.rollback()  # a concurrent request with the same Idempotency-Key committed first
        replayed = idempotency.replayed_id(session, principal, route=ROUTE, key=idempotency_key,
                                           request_hash=request_hash)
        if replayed is None:
            raise
        return store.get_sweep(session, sweep_id=replayed)
    for job_id in created:
        deliver_now(session, queue, job_id=job_id)
    return sweep


def _trial_job(session: Session, settings: Settings, principal: Principal, spec: SweepCreate, index: int,
               params: dict[str, Any]) -> Job:
    """The trial as a validated (unsaved) job; its errors name the sweep's field at fault."""
    base = spec.job.request()
    try:
        job_spec = validate_spec(base | {"hyperparameters": base["hyperparameters"] | params})
        return prepare_job(session, settings, principal, spec=job_spec)
    except ValidationFailed as exc:
        name = (exc.field or "").removeprefix("hyperparameters.")
        field = f"parameters.{name}" if name in params else f"job.{exc.field}"
        raise ValidationFailed(field, f"trial {index} ({format_params(params)}): {exc.message}",
                               code=exc.code) from exc


def get_sweep(session: Session, principal: Principal, *, sweep_id: str) -> Sweep:
    """One sweep by id."""
    return store.get_sweep(session, sweep_id=sweep_id, tenant=principal.scope)


def list_sweeps(session: Session, principal: Principal, *, limit: int, cursor: str | None
                ) -> tuple[list[Sweep], str | None]:
    """A page of sweeps and the cursor of the next one."""
    after = decode_cursor(cursor) if cursor else None
    return split_page(store.list_sweeps(session, limit=limit + 1, tenant=principal.scope, after=after), limit)


def cancel_sweep(session: Session, queue: TaskQueue, principal: Principal, *, sweep_id: str) -> Sweep:
    """Stop creating children and cancel the queued and running ones."""
    sweep = store.get_sweep(session, sweep_id=sweep_id, tenant=principal.scope, for_update=True)
    if sweep.status != SweepStatus.RUNNING:
        raise Conflict(f"sweep {sweep_id!r} has already {sweep.status}", field="status")
    sweep.status, sweep.finished_at = SweepStatus.CANCELLED, utcnow()
    active = [child for child in sweep.children if child.status in ACTIVE]
    for child in active:
        request_cancel(session, child, why=f" (sweep {sweep.id} cancelled)")
    best = best_child(sweep, list(sweep.children))
    sweep.best_job_id = best.id if best is not None else None
    session.commit()
    for child in active:
        if child.task_id and child.status not in ACTIVE:
            queue.revoke(child.task_id)
    return sweep


def sweep_waiting(session: Session, settings: Settings, sweep: Sweep) -> str | None:
    """Why a running sweep with trials left starts none now (its tenant is at its job limit), else None."""
    children = list(sweep.children)
    active = sum(1 for child in children if child.status in ACTIVE)
    if sweep.status != SweepStatus.RUNNING or len(children) >= len(sweep.trials) or active >= sweep.parallelism:
        return None
    tenant_active = job_store.count_jobs(session, tenant=sweep.tenant_id, statuses=sorted(ACTIVE))
    if tenant_active < settings.max_active_jobs_per_tenant:
        return None  # room again: the next advance (after a child ends, or the periodic round) starts a trial
    return waiting_reason(tenant_active, settings)


def sweep_read(sweep: Sweep, waiting: str | None = None) -> SweepRead:
    """The public sweep object: every trial with its child's status and best, the best child, and why it waits."""
    children = {child.sweep_index: child for child in sweep.children}
    trials = []
    for index, trial in enumerate(sweep.trials):
        child = children.get(index)
        trials.append(SweepTrialRead(
            index=index, params=trial["params"], job_id=child.id if child else None,
            status=child.status if child else "pending", stop_reason=child.stop_reason if child else None,
            best=BestRead(**child.best) if child is not None and child.best else None))
    best_job = children.get(next((c.sweep_index for c in sweep.children if c.id == sweep.best_job_id), None))
    if best_job is None and sweep.status == SweepStatus.RUNNING:
        best_job = best_child(sweep, list(sweep.children))  # the best so far
    best = None
    if best_job is not None and best_job.best:
        best = SweepBest(job_id=best_job.id, trial=best_job.sweep_index or 0, **best_job.best)
    return SweepRead(
        id=sweep.id, status=sweep.status, method=sweep.method,
        parameters={k: ParameterSpec.model_validate(v) for k, v in sweep.parameters.items()},
        parallelism=sweep.parallelism, metric=sweep.metric, greater_is_better=sweep.greater_is_better,
        pruning=PruningSpec.model_validate(sweep.pruning) if sweep.pruning else None, best=best, trials=trials,
        base_job=sweep.job_spec, created_at=sweep.created_at, finished_at=sweep.finished_at, waiting_reason=waiting)
