"""Reproducibility: rerun a job exactly (same resolved config, datasets and seed) and compare jobs field by field."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from app.schemas.jobs import Difference, JobComparison
from app.services.jobs import create_job
from core.auth import Principal
from core.errors import ValidationFailed
from core.jobspec import validate_spec
from core.queue import TaskQueue
from core.rows import Job
from core.settings import Settings
from core.store import jobs as store

RERUN_ROUTE = "POST /jobs/{id}/rerun"
MAX_COMPARED = 10


def rerun_job(session: Session, settings: Settings, queue: TaskQueue, principal: Principal, *, job_id: str,
              idempotency_key: str | None) -> Job:
    """A new job with the original's resolved hyperparameters (seed included), datasets and model, validated
    again like any POST /jobs (a deleted dataset is a 422); a retry with the same Idempotency-Key returns it."""
    original = store.get_job(session, job_id=job_id, tenant=principal.scope)
    if original.train_dataset_id is None:
        raise ValidationFailed("train_dataset", f"the training dataset of {job_id} was deleted; it cannot be rerun")
    spec = validate_spec({
        "task": original.task, "base_model": original.base_model, "model_config": original.model_config_,
        "train_dataset": original.train_dataset_id, "eval_dataset": original.eval_dataset_id,
        "text_column": original.text_column, "label_column": original.label_column,
        "hyperparameters": dict(original.hyperparameters), "metadata": dict(original.metadata_ or {}),
        "priority": original.priority,
        **({"adapter": original.adapter} if original.adapter else {}),
        **({"method": original.method} if original.method else {})})
    return create_job(session, settings, queue, principal, spec=spec, idempotency_key=idempotency_key,
                      route=RERUN_ROUTE, rerun_of=original.id)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} as {"a.b": 1}; lists stay values."""
    if not isinstance(value, dict) or not value:
        return {prefix: value} if prefix else {}
    flat: dict[str, Any] = {}
    for key, item in value.items():
        flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def comparable(job: Job) -> dict[str, Any]:
    """The settings and receipt of a job as dotted fields."""
    return flatten({"task": job.task, "base_model": job.base_model, "model_config": job.model_config_,
                    "train_dataset": job.train_dataset_id, "eval_dataset": job.eval_dataset_id,
                    "text_column": job.text_column, "label_column": job.label_column, "priority": job.priority,
                    "hyperparameters": job.hyperparameters, "receipt": job.receipt or {}})


def compare_jobs(session: Session, principal: Principal, *, ids: list[str]) -> JobComparison:
    """What differs between 2-10 jobs: every settings and receipt field whose values are not all equal."""
    ids = list(dict.fromkeys(i.strip() for i in ids if i.strip()))
    if not 2 <= len(ids) <= MAX_COMPARED:
        raise ValidationFailed("ids", f"give 2 to {MAX_COMPARED} distinct job ids, comma-separated")
    fields = [comparable(store.get_job(session, job_id=i, tenant=principal.scope)) for i in ids]
    names = sorted(set().union(*fields))
    differences = [Difference(field=n, values=[f.get(n) for f in fields]) for n in names
                   if any(f.get(n) != fields[0].get(n) for f in fields[1:])]
    return JobComparison(ids=ids, differences=differences, identical=len(names) - len(differences))
