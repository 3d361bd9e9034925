"""Every on-disk layout in one place: where datasets, job models, checkpoints and packaged assets live."""

from __future__ import annotations

from pathlib import Path

from core.settings import Settings

# The GPT-2 BPE tokenizer files (vocab.json, merges.txt) ship inside the `core` package as package data,
# so the wheel and the container image carry them. Source: ../shared/data/gpt2-tokenizer (see its SOURCES.md).
GPT2_TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "gpt2-tokenizer"

MODEL_DIRNAME = "model"
CHECKPOINTS_DIRNAME = "checkpoints"
MANIFEST_NAME = "manifest.json"


def job_dir(settings: Settings, job_id: str) -> Path:
    """The folder of everything a job writes: <home>/jobs/<id>."""
    return settings.jobs_dir / job_id


def job_model_dir(settings: Settings, job_id: str) -> Path:
    """A finished job's save_pretrained folder (plus manifest): <home>/jobs/<id>/model."""
    return job_dir(settings, job_id) / MODEL_DIRNAME


def job_checkpoints_dir(settings: Settings, job_id: str) -> Path:
    """A job's rotating checkpoints: <home>/jobs/<id>/checkpoints."""
    return job_dir(settings, job_id) / CHECKPOINTS_DIRNAME


def dataset_file(settings: Settings, stored_name: str) -> Path:
    """An uploaded dataset's file, stored under a server-chosen name."""
    return settings.datasets_dir / stored_name


def relative_to_home(settings: Settings, path: Path) -> str:
    """How a path under home is recorded in a row (relative, so a home folder can move)."""
    return str(path.resolve().relative_to(settings.home.resolve()))


def from_home(settings: Settings, stored: str) -> Path:
    """The absolute path of a path recorded relative to home."""
    return settings.home / stored
