"""Classification with a finished job's model (training lives in worker/training/)."""

from __future__ import annotations

from typing import Any

from core.paths import MANIFEST_NAME, job_model_dir
from worker.context import WorkerContext


def _classifiers(ctx: WorkerContext) -> Any:
    from worker.engines.classify import ClassifierCache

    return ClassifierCache()


def classify_texts(ctx: WorkerContext, job_id: str, texts: list[str]) -> list[dict[str, Any]]:
    """Predictions from a finished job's model; the model stays loaded in this process."""
    model_dir = job_model_dir(ctx.settings, job_id)
    if not (model_dir / MANIFEST_NAME).is_file():
        raise FileNotFoundError(f"model of job {job_id} is not on this worker's disk")
    result: list[dict[str, Any]] = ctx.service("classifiers", _classifiers).get(model_dir).predict(texts)
    return result
