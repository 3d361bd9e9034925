"""Checkpoint publishing: upload a checkpoint the engine wrote, then record it (rotating away the rows of
checkpoints the engine pruned) with its event and `job.checkpoint` webhook, fenced by the attempt."""

from __future__ import annotations

import logging
from pathlib import Path

from core.paths import relative_to_home
from core.rows import Artifact, ArtifactKind, EventKind, WebhookEventType, new_id, utcnow
from core.settings import Settings
from core.storage import ArtifactStore
from core.store import jobs as store
from core.store import webhooks
from worker.jobs.progress import ProgressWriter
from worker.jobs.sync import push_checkpoint

log = logging.getLogger(__name__)


def artifact_row(settings: Settings, job_id: str, kind: str, path: Path, step: int | None) -> Artifact:
    """An artifact row for a folder the engine wrote under home (its path relative to home is its storage key)."""
    files = [p for p in path.rglob("*") if p.is_file()]
    return Artifact(id=new_id("art"), job_id=job_id, kind=kind, path=relative_to_home(settings, path), step=step,
                    size_bytes=sum(p.stat().st_size for p in files),
                    files=sorted(str(p.relative_to(path)) for p in files), created_at=utcnow())


class CheckpointPublisher:
    """Stores each checkpoint of one attempt and records its artifact row, event and webhook."""

    def __init__(self, settings: Settings, storage: ArtifactStore, writer: ProgressWriter) -> None:
        self.settings = settings
        self.storage = storage
        self.writer = writer

    def publish(self, step: int, path: Path) -> None:
        """Upload the checkpoint folder, then record it; a failed upload is an event and training goes on."""
        writer, job_id = self.writer, self.writer.job_id
        if writer.lost.is_set():
            return  # a newer attempt holds the job: its checkpoints in the store are not ours to replace
        try:
            push_checkpoint(self.storage, job_id, path)
        except Exception as exc:  # noqa: BLE001 - training goes on; the next checkpoint is uploaded again
            log.warning("job %s: checkpoint at step %d not stored", job_id, step, exc_info=True)
            writer.event(EventKind.CHECKPOINT_NOT_STORED, f"checkpoint at step {step} could not be stored ({exc}); "
                         "training goes on and the next one is tried", level="warning")
            return
        with writer.fenced() as session:
            store.fence(session, job_id=job_id, attempt=writer.attempt)
            job = store.get_job(session, job_id=job_id)
            for old in [a for a in job.artifacts if a.kind == ArtifactKind.CHECKPOINT]:
                if not self.storage.exists(old.path):  # rotated away
                    session.delete(old)
            row = artifact_row(self.settings, job_id, ArtifactKind.CHECKPOINT, path, step)
            store.add_artifact(session, artifact=row, attempt=writer.attempt)
            store.add_event(session, job_id=job_id, kind=EventKind.CHECKPOINT, message=f"checkpoint at step {step}",
                            attempt=writer.attempt)
            webhooks.emit(session, tenant_id=job.tenant_id, type=WebhookEventType.JOB_CHECKPOINT,
                          data=webhooks.job_data(job, checkpoint_step=step))
