"""Artifact downloads: a job's model or checkpoint folder, packed as a tar archive."""

from __future__ import annotations

import tarfile
import tempfile
from pathlib import Path

from sqlalchemy.orm import Session

from core.auth import Principal
from core.errors import NotFound
from core.settings import Settings
from core.store import jobs as store


def pack_artifact(session: Session, settings: Settings, principal: Principal, *, job_id: str,
                  artifact_id: str) -> tuple[Path, str]:
    """Write the artifact folder into a temporary tar file; return its path and a download name."""
    store.get_job(session, job_id=job_id, tenant=principal.scope)
    artifact = store.get_artifact(session, job_id=job_id, artifact_id=artifact_id)
    home = settings.home.resolve()
    folder = (home / artifact.path).resolve()
    # Artifact paths are written by workers, but are checked to stay under home all the same.
    if not folder.is_relative_to(home) or not folder.is_dir():
        raise NotFound(f"artifact {artifact_id!r} is no longer on disk (checkpoints are rotated)")
    handle = tempfile.NamedTemporaryFile(prefix="trainserve-", suffix=".tar", delete=False)
    with handle, tarfile.open(fileobj=handle, mode="w") as tar:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and not path.is_symlink():
                tar.add(path, arcname=str(Path(artifact.kind) / path.relative_to(folder)))
    return Path(handle.name), f"{job_id}-{artifact.kind}{'-' + str(artifact.step) if artifact.step else ''}.tar"
