"""Celery tasks: thin wrappers that hand a job id and the process's context on. Torch loads only inside them."""

from __future__ import annotations

from typing import Any

from core.tasks import TASK_CLASSIFY, TASK_GENERATE, TASK_TRAIN
from worker.app import celery, context


@celery.task(name=TASK_TRAIN, ignore_result=True)
def train(job_id: str) -> None:
    """Run (or resume, or skip if already finished) the fine-tune recorded in row `job_id`."""
    from worker.training.lifecycle import run_training_job

    run_training_job(context(), job_id)


@celery.task(name=TASK_CLASSIFY)
def classify(job_id: str, texts: list[str]) -> list[dict[str, Any]]:
    """Predict labels with the finished model of job `job_id`, kept warm between calls."""
    from worker.runner import classify_texts

    return classify_texts(context(), job_id, texts)


@celery.task(name=TASK_GENERATE, ignore_result=True, acks_late=False)
def generate(payload: dict[str, Any]) -> None:
    """Serve one generation request; many run at once in a thread pool so the batcher has work."""
    from worker.serving import serve

    serve(payload)
