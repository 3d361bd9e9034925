"""A model folder's manifest (manifest.json, written last as the folder's completion mark): what it is, what made it."""

from __future__ import annotations

import json
import os
import platform
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.paths import MANIFEST_NAME

if TYPE_CHECKING:
    from worker.engines.device import DevicePlan

MERGED_DIR = "merged"  # an adapter artifact's full-model copy, when its adapter asks for one (merge: true)


def build_manifest(*, base_model: str | None, base_model_name: str, labels: list[int | str] | None = None,
                   hyperparameters: dict[str, Any], dataset_hashes: dict[str, str],
                   metrics: dict[str, float], plan: DevicePlan,
                   task: str = "text-classification", data: dict[str, Any] | None = None) -> dict[str, Any]:
    """The self-description stored next to a trained model (labels only for tasks that have them)."""
    manifest: dict[str, Any] = {
        "task": task,
        "base_model": base_model,
        "base_model_name": base_model_name or base_model,
    }
    if labels is not None:
        manifest["labels"] = list(labels)
    if data is not None:
        manifest["data"] = data
    return manifest | {
        "hyperparameters": hyperparameters,
        "dataset_hashes": dict(dataset_hashes),
        "metrics": metrics,
        "versions": library_versions(),
        "device": plan.device,
        "precision": plan.precision,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def library_versions() -> dict[str, str]:
    """Versions of what decides a run's numbers: the manifest and the job's receipt record them."""
    # Imported here: reading a manifest (what the generation worker does) needs none of them.
    import datasets
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "datasets": datasets.__version__,
            "python": platform.python_version()}


def write_manifest(output_dir: Path, manifest: dict[str, Any]) -> Path:
    """Write manifest.json atomically (tmp file, then rename)."""
    target = Path(output_dir) / MANIFEST_NAME
    tmp = target.with_name(f".{MANIFEST_NAME}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, target)
    return target


def read_manifest(model_dir: Path) -> dict[str, Any] | None:
    """The manifest of a model folder, or None when it has none."""
    path = Path(model_dir) / MANIFEST_NAME
    return json.loads(path.read_text()) if path.is_file() else None
