"""A job's evaluations as a checkpoint list (like OpenAI's fine-tuning checkpoints): metrics, best, download."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from sqlalchemy.orm import Session

from app.schemas.fine_tuning import FineTuningJobCheckpoint, FineTuningJobCheckpointList
from app.schemas.jobs import BestRead, CheckpointList, CheckpointRead
from core.auth import Principal
from core.errors import NotFound
from core.jobspec import KINDS
from core.rows import ArtifactKind, JobStatus
from core.store import jobs as store


def list_checkpoints(session: Session, principal: Principal, *, job_id: str, since_step: int,
                     limit: int) -> CheckpointList:
    """Every evaluated step from `since_step` on, oldest first, with the artifact kept for it (if any)."""
    job = store.get_job(session, job_id=job_id, tenant=principal.scope)
    names = list(KINDS[job.task].metrics) if job.task in KINDS else []
    points = store.list_metric_points(session, job_id=job_id, since_step=since_step, names=names,
                                      limit=(limit + 1) * len(names))
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    created: dict[int, datetime] = {}
    for point in points:
        by_step[point.step][point.name] = point.value
        created.setdefault(point.step, point.created_at)
    # The model folder holds the best step's weights once the job succeeded: prefer it to that step's checkpoint.
    kept = {a.step: a for a in job.artifacts if a.kind == ArtifactKind.CHECKPOINT}
    if job.status == JobStatus.SUCCEEDED:
        kept.update({a.step: a for a in job.artifacts if a.kind == ArtifactKind.MODEL})
    best_step = job.best["step"] if job.best else None
    data = []
    for step in sorted(by_step)[:limit]:
        artifact = kept.get(step)
        data.append(CheckpointRead(
            id=f"{job.id}:step-{step}", step=step, metrics=by_step[step], is_best=step == best_step,
            created_at=created[step], artifact_id=artifact.id if artifact else None,
            download_url=f"/jobs/{job.id}/artifacts/{artifact.id}/download" if artifact else None))
    return CheckpointList(job_id=job.id, best=BestRead(**job.best) if job.best else None, data=data)


MAX_CHECKPOINTS = 1000  # evaluations of one job listed (OpenAI pages them newest first)


def fine_tuning_checkpoints(session: Session, principal: Principal, *, job_id: str, after: str | None,
                            limit: int) -> FineTuningJobCheckpointList:
    """A job's evaluations as OpenAI's checkpoints, newest first; `after` is the previous page's last id."""
    job = store.get_job(session, job_id=job_id, tenant=principal.scope)
    listed = list(reversed(list_checkpoints(session, principal, job_id=job_id, since_step=0,
                                            limit=MAX_CHECKPOINTS).data))
    if after is not None:
        index = next((i for i, c in enumerate(listed) if c.id == after), None)
        if index is None:
            raise NotFound(f"checkpoint {after!r} not found on job {job_id!r}", field="after")
        listed = listed[index + 1:]
    served = job.status == JobStatus.SUCCEEDED
    data = [FineTuningJobCheckpoint(
        id=c.id, created_at=int(c.created_at.timestamp()), fine_tuning_job_id=job.id, step_number=c.step,
        fine_tuned_model_checkpoint=job.id if c.is_best and served else c.id,
        metrics={"step": float(c.step), **({"valid_loss": c.metrics["eval_loss"],
                                            "full_valid_loss": c.metrics["eval_loss"]}
                                           if "eval_loss" in c.metrics else {}), **c.metrics})
        for c in listed[:limit]]
    return FineTuningJobCheckpointList.of(data, has_more=len(listed) > limit)
