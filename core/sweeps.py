"""Sweeps at run time: create child jobs as slots free, prune children that fall behind, name the best child.

`advance` is the one place children are made. It runs under the sweep's row lock, creates the next trials'
jobs (each with its outbox message, in the caller's transaction) until `parallelism` children are queued or
running, and finishes the sweep once every trial has ended. The API calls it when a sweep is created, the
worker after each child ends, and a periodic round on every training worker catches what a crash missed:
running it twice creates nothing twice (one child per trial index, enforced by a unique constraint).

Pruning is the median stopping rule (Optuna's MedianPruner, Ray Tune's MedianStoppingRule): after at least
`min_evaluations` evaluations, a child whose best value so far is worse than the median of the other
children's values at the same step (when at least `min_trials` of them reached it) is stopped. It ends as
`succeeded` with `stop_reason: "pruned"` and keeps its best checkpoint, like an early stop.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from core import states
from core.rows import ACTIVE, Job, JobStatus, MetricPoint, Sweep, SweepStatus, WebhookEventType, new_id, utcnow
from core.periodic import Periodic
from core.queue import TaskQueue
from core.relay import deliver_now
from core.store import webhooks

log = logging.getLogger(__name__)


def advance(session: Session, *, sweep_id: str) -> list[str]:
    """Create children up to the parallelism limit and finish a sweep whose trials all ended; the caller commits."""
    sweep = session.scalars(select(Sweep).where(Sweep.id == sweep_id).with_for_update()).first()
    if sweep is None or sweep.status != SweepStatus.RUNNING:
        return []
    children = list(session.scalars(select(Job).where(Job.sweep_id == sweep_id)))
    active = sum(1 for child in children if child.status in ACTIVE)
    index = max((child.sweep_index or 0 for child in children), default=-1) + 1
    created = []
    while active < sweep.parallelism and index < len(sweep.trials):
        job = Job(id=new_id("job"), tenant_id=sweep.tenant_id, status=JobStatus.QUEUED, metrics={},
                  created_at=utcnow(), sweep_id=sweep.id, sweep_index=index,
                  hyperparameters=sweep.trials[index]["hyperparameters"], **sweep.template)
        states.create(session, job, message=f"created by sweep {sweep.id} (trial {index}: "
                                            f"{format_params(sweep.trials[index]['params'])})")
        created.append(job.id)
        active += 1
        index += 1
    if active == 0 and index >= len(sweep.trials):
        best = best_child(sweep, children)
        sweep.status, sweep.finished_at = SweepStatus.SUCCEEDED, utcnow()
        sweep.best_job_id = best.id if best is not None else None
        webhooks.emit(session, tenant_id=sweep.tenant_id, type=WebhookEventType.SWEEP_FINISHED,
                      data={"id": sweep.id, "object": "sweep", "status": sweep.status,
                            "best_job_id": sweep.best_job_id})
    return created


def advance_and_send(factory: sessionmaker[Session], queue: TaskQueue, *, sweep_id: str) -> list[str]:
    """advance() in its own transaction, then send the new children's messages (the relay retries refusals)."""
    try:
        with factory() as session:
            created = advance(session, sweep_id=sweep_id)
            session.commit()
    except IntegrityError:  # another process advanced the same sweep at the same moment (SQLite has no row lock)
        log.info("sweep %s was advanced concurrently; the next round sees its children", sweep_id)
        return []
    with factory() as session:
        for job_id in created:
            deliver_now(session, queue, job_id=job_id)
    return created


def advance_all(factory: sessionmaker[Session], queue: TaskQueue) -> int:
    """One periodic round: advance every running sweep; returns how many children it created."""
    with factory() as session:
        running = list(session.scalars(select(Sweep.id).where(Sweep.status == SweepStatus.RUNNING)))
    return sum(len(advance_and_send(factory, queue, sweep_id=sweep_id)) for sweep_id in running)


def sweep_thread(factory: sessionmaker[Session], queue: TaskQueue, interval: float) -> Periodic:
    """A daemon thread that advances running sweeps every `interval` seconds (a crash-safe backstop)."""
    return Periodic("sweep-advance", interval, lambda: advance_all(factory, queue))


def best_child(sweep: Sweep, children: list[Job]) -> Job | None:
    """The child whose best evaluation is best for the sweep's metric (succeeded children first)."""
    scored = [c for c in children if c.best is not None and c.best.get("value") is not None]
    finished = [c for c in scored if c.status == JobStatus.SUCCEEDED] or scored
    if not finished:
        return None
    sign = 1.0 if sweep.greater_is_better else -1.0
    return max(finished, key=lambda c: (sign * float(c.best["value"]), -(c.sweep_index or 0)))  # type: ignore[index]


def prune_reason(session: Session, *, job_id: str, sweep_id: str, step: int) -> str | None:
    """Why the median stopping rule stops this child at `step`, or None to let it go on."""
    sweep = session.get(Sweep, sweep_id)
    if sweep is None or sweep.pruning is None or sweep.status != SweepStatus.RUNNING:
        return None
    own = list(session.scalars(select(MetricPoint.value).where(
        MetricPoint.job_id == job_id, MetricPoint.name == sweep.metric, MetricPoint.step <= step)))
    if len(own) < int(sweep.pruning["min_evaluations"]):
        return None
    others = list(session.scalars(select(MetricPoint.value).join(Job, Job.id == MetricPoint.job_id).where(
        Job.sweep_id == sweep_id, Job.id != job_id, MetricPoint.name == sweep.metric, MetricPoint.step == step)))
    if len(others) < int(sweep.pruning["min_trials"]):
        return None
    best = max(own) if sweep.greater_is_better else min(own)
    median = statistics.median(others)
    behind = best < median if sweep.greater_is_better else best > median
    if not behind:
        return None
    return (f"pruned at step {step}: best {sweep.metric} so far {best:.4f} is worse than the median {median:.4f} "
            f"of {len(others)} other trial(s) at this step")


def format_params(params: dict[str, Any]) -> str:
    """A trial's sampled values, short: learning_rate=0.001, batch_size=8."""
    return ", ".join(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}"
                     for name, value in params.items())
