"""Artifact downloads: a job's model or checkpoint folder, read from the artifact store and packed as a tar."""

from __future__ import annotations

import tarfile
import tempfile
from pathlib import Path, PurePosixPath

from sqlalchemy.orm import Session

from core.auth import Principal
from core.errors import NotFound, StorageUnavailable
from core.storage import ArtifactStore
from core.store import jobs as store


def pack_artifact(session: Session, storage: ArtifactStore, principal: Principal, *, job_id: str,
                  artifact_id: str) -> tuple[Path, str]:
    """Write the artifact folder into a temporary tar file; return its path and a download name."""
    store.get_job(session, job_id=job_id, tenant=principal.scope)
    artifact = store.get_artifact(session, job_id=job_id, artifact_id=artifact_id)
    try:
        files = storage.files(artifact.path)  # keys are checked to stay under the store's root
    except (OSError, ValueError) as exc:
        raise StorageUnavailable(f"could not list artifact {artifact_id!r} in {storage.url}: {exc}") from exc
    if not files:
        raise NotFound(f"artifact {artifact_id!r} is no longer stored (checkpoints are rotated)")
    handle = tempfile.NamedTemporaryFile(prefix="trainserve-", suffix=".tar", delete=False)
    try:
        with handle, tarfile.open(fileobj=handle, mode="w") as tar:
            for name, size in files:
                info = tarfile.TarInfo(str(PurePosixPath(artifact.kind) / name))
                info.size = size
                with storage.open(f"{artifact.path}/{name}") as stream:  # copied in chunks, never whole
                    tar.addfile(info, stream)
    except OSError as exc:
        Path(handle.name).unlink(missing_ok=True)
        raise StorageUnavailable(f"could not read artifact {artifact_id!r} from {storage.url}: {exc}") from exc
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise
    return Path(handle.name), f"{job_id}-{artifact.kind}{'-' + str(artifact.step) if artifact.step else ''}.tar"
