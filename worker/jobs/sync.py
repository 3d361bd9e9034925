"""A job's checkpoints and model between this host's work folder and the artifact store.

The engine reads and writes local folders (<home>/jobs/<id>/...). Before a run the newest complete
checkpoint in the store comes down, unless this host already has one as recent (the job may have run on
another host until that host died); each checkpoint goes up as soon as it is written (state.json last),
and the final model (manifest.json last) before the job is marked succeeded. With the store in <home>
(one host) the folders are the objects and nothing moves.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from core.paths import MANIFEST_NAME, job_checkpoints_dir, job_checkpoints_key, job_dir, job_model_key
from core.settings import Settings
from core.storage import ArtifactStore
from worker.engines.training.artifacts import STATE, checkpoint_step, latest_checkpoint, list_checkpoints
from worker.model_store import storage_errors

log = logging.getLogger(__name__)


def stored_checkpoints(storage: ArtifactStore, job_id: str) -> list[int]:
    """Steps of the job's complete checkpoints in the store, oldest first."""
    key = job_checkpoints_key(job_id)
    steps = sorted(step for name in storage.children(key) if (step := checkpoint_step(name)) is not None)
    return [step for step in steps if storage.exists(f"{key}/checkpoint-{step}/{STATE}")]


def pull_checkpoint(storage: ArtifactStore, settings: Settings, job_id: str) -> int | None:
    """Download the stored checkpoints when this host has none as recent; the newest step, or None.

    The store holds what the engine keeps (the latest and the best): both come, since the loop restores the
    best weights at the end of the run.
    """
    if storage.is_home:
        return None
    with storage_errors(f"list the checkpoints of {job_id} in {storage.url}"):
        steps = stored_checkpoints(storage, job_id)
        if not steps:
            return None
        root = job_checkpoints_dir(settings, job_id)
        local = latest_checkpoint(root)
        if local is not None and (checkpoint_step(local.name) or 0) >= steps[-1]:
            return None
        have = {checkpoint_step(p.name) for p in list_checkpoints(root)}
        for step in steps:
            if step not in have:
                storage.download_dir(f"{job_checkpoints_key(job_id)}/checkpoint-{step}", root / f"checkpoint-{step}",
                                     marker=STATE)
    log.info("job %s: downloaded checkpoints up to %d from %s", job_id, steps[-1], storage.url)
    return steps[-1]


def push_checkpoint(storage: ArtifactStore, job_id: str, path: Path) -> None:
    """Upload a checkpoint folder (state.json last), then drop the older stored ones the engine no longer keeps."""
    if storage.is_home:
        return  # the engine wrote it in place and rotated the old ones
    key = job_checkpoints_key(job_id)
    with storage_errors(f"upload {path.name} of {job_id} to {storage.url}"):
        storage.upload_dir(path, f"{key}/{path.name}", marker=STATE)
        keep = {checkpoint_step(p.name) for p in list_checkpoints(path.parent)}  # the latest and the best
        current = checkpoint_step(path.name) or 0
        for name in storage.children(key):
            step = checkpoint_step(name)
            # Only older ones: a newer checkpoint in the store belongs to an attempt that replaced this one.
            if step is not None and step < current and step not in keep:
                storage.delete(f"{key}/{name}")


def push_model(storage: ArtifactStore, job_id: str, model_dir: Path) -> None:
    """Upload the finished model folder, manifest.json last: a host that sees the manifest sees it all."""
    with storage_errors(f"upload the model of {job_id} to {storage.url}"):
        storage.upload_dir(model_dir, job_model_key(job_id), marker=MANIFEST_NAME)


def clear_work(storage: ArtifactStore, settings: Settings, job_id: str) -> None:
    """Remove this host's work folder of a finished job (its model and checkpoints are in the store)."""
    if not storage.is_home:  # in <home> the work folder is the store itself
        shutil.rmtree(job_dir(settings, job_id), ignore_errors=True)
