"""A job's evaluations as a checkpoint list (like OpenAI's fine-tuning checkpoints): metrics, best, download."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from sqlalchemy.orm import Session

from app.schemas.jobs import BestRead, CheckpointList, CheckpointRead
from core.auth import Principal
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
