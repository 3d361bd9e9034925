"""Finished models between the artifact store and this host: what the inference servers and a continuing job load.

A job's model folder comes down once per host (manifest.json marks a complete one); a LoRA adapter's artifact is
also read whole (its merged/ copy, or the base with the adapter folded in) by what cannot apply an adapter itself.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from core.errors import DomainError, StorageUnavailable
from core.paths import MANIFEST_NAME, job_model_key
from core.storage import ArtifactStore
from worker.engines.models.adapters import export_merged, is_adapter
from worker.engines.models.manifest import MERGED_DIR


@contextmanager
def storage_errors(action: str) -> Iterator[None]:
    """Report any failure of the store as StorageUnavailable (a job failing on it records that code)."""
    try:
        yield
    except (DomainError, FileNotFoundError, ValueError):
        raise
    except Exception as exc:  # noqa: BLE001 - s3fs, aiohttp and botocore raise many kinds
        raise StorageUnavailable(f"could not {action}: {type(exc).__name__}: {exc}") from exc


def fetch_model(storage: ArtifactStore, job_id: str) -> Path:
    """A local copy of a finished job's model folder (downloaded once per host); FileNotFoundError if absent."""
    with storage_errors(f"download the model of {job_id} from {storage.url}"):
        folder = storage.fetch_dir(job_model_key(job_id), marker=MANIFEST_NAME)
    if folder is None:
        raise FileNotFoundError(f"the model of job {job_id} is not in the artifact store ({storage.url})")
    return folder


def fetch_full_model(storage: ArtifactStore, job_id: str) -> Path:
    """A local folder with a finished job's full model, for what loads whole weights (the generation engine's base,
    a job continuing from another): the model folder itself; for an adapter, the artifact's merged/ copy when
    training wrote one (adapter.merge), else the base with the adapter folded in, written once per host next to the
    fetched copy."""
    folder = fetch_model(storage, job_id)
    if not is_adapter(folder):
        return folder
    if (folder / MERGED_DIR / MANIFEST_NAME).is_file():
        return folder / MERGED_DIR
    merged = folder.parent / f"{folder.name}.merged"
    if not (merged / MANIFEST_NAME).is_file():
        staging = folder.parent / f".{folder.name}.merged.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        export_merged(folder, staging)
        shutil.rmtree(merged, ignore_errors=True)
        os.replace(staging, merged)
    return merged
