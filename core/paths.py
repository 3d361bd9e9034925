"""Every layout in one place: where datasets, job models, checkpoints and packaged assets live.

A stored object's key (core.storage) is its path relative to home, and rows record it: the same layout
serves one host (objects are files under home) and many (objects in S3, local copies under home).
"""

from __future__ import annotations

from pathlib import Path

from core.settings import Settings

# The GPT-2 BPE tokenizer files (vocab.json, merges.txt) ship inside the `core` package as package data,
# so the wheel and the container image carry them. Source: ../shared/data/gpt2-tokenizer (see its SOURCES.md).
GPT2_TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "gpt2-tokenizer"

MODEL_DIRNAME = "model"
CHECKPOINTS_DIRNAME = "checkpoints"
MANIFEST_NAME = "manifest.json"  # written last into a model folder: its presence marks a complete one


def job_key(job_id: str) -> str:
    """The key of everything a job writes: jobs/<id>."""
    return f"jobs/{job_id}"


def job_model_key(job_id: str) -> str:
    """A finished job's save_pretrained folder (plus manifest): jobs/<id>/model."""
    return f"{job_key(job_id)}/{MODEL_DIRNAME}"


def job_checkpoints_key(job_id: str) -> str:
    """A job's rotating checkpoints: jobs/<id>/checkpoints."""
    return f"{job_key(job_id)}/{CHECKPOINTS_DIRNAME}"


def dataset_key(stored_name: str) -> str:
    """An uploaded dataset's file, stored under a server-chosen name: datasets/<name>."""
    return f"datasets/{stored_name}"


def job_dir(settings: Settings, job_id: str) -> Path:
    """The local folder of everything a job writes on this host: <home>/jobs/<id>."""
    return settings.home / job_key(job_id)


def job_model_dir(settings: Settings, job_id: str) -> Path:
    """Where this host writes a job's final model before it is stored: <home>/jobs/<id>/model."""
    return settings.home / job_model_key(job_id)


def job_checkpoints_dir(settings: Settings, job_id: str) -> Path:
    """Where this host writes and resumes a job's checkpoints: <home>/jobs/<id>/checkpoints."""
    return settings.home / job_checkpoints_key(job_id)


def relative_to_home(settings: Settings, path: Path) -> str:
    """How a path under home is recorded in a row (relative, so a home folder can move): its storage key."""
    return Path(path).resolve().relative_to(settings.home.resolve()).as_posix()
