"""The reproducibility receipt: what a job ran with (code, libraries, device, precision, data, seed, config)."""

from __future__ import annotations

import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from core.rows import Job
from worker.engines.models.manifest import library_versions
from worker.jobs.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


@lru_cache(maxsize=1)
def code_version() -> dict[str, str | None]:
    """The installed package version and, in a git checkout, the commit (plus `dirty` when files changed)."""
    try:
        version: str | None = metadata.version("trainserve")
    except metadata.PackageNotFoundError:
        version = None
    commit = None
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5)
        if head.returncode == 0:
            commit = head.stdout.strip()
            status = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=5)
            if status.returncode == 0 and status.stdout.strip():
                commit += "-dirty"
    except (OSError, subprocess.SubprocessError):
        pass  # no git, or not a checkout (a wheel install): the version alone
    return {"version": version, "git_commit": commit}


def base_receipt(job: Job, config: EngineConfig) -> dict[str, Any]:
    """Everything but the device and precision, which the engine decides when it starts (JobReporter adds them)."""
    return {
        "code": code_version(),
        "libraries": library_versions(),
        "datasets": dict(config.dataset_hashes),
        "seed": config.seed,
        "config": {"task": job.task, "base_model": job.base_model, "model_config": job.model_config_,
                   "train_dataset": job.train_dataset_id, "eval_dataset": job.eval_dataset_id,
                   "text_column": job.text_column, "label_column": job.label_column, "labels": list(job.labels),
                   "hyperparameters": dict(job.hyperparameters),
                   "checkpoint_steps": config.checkpoint_steps},
    }
