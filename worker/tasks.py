"""Celery tasks: thin wrappers that hand a job id and the process's context on. Torch loads only inside them."""

from __future__ import annotations

from typing import Any

from core.tasks import TASK_BATCH, TASK_CLASSIFY, TASK_EMBED, TASK_GENERATE, TASK_JOIN, TASK_TRAIN
from worker.app import celery, context


@celery.task(name=TASK_TRAIN, ignore_result=True)
def train(job_id: str) -> None:
    """Wake up: run (or resume) the queued job whose turn it is by fair share, which need not be `job_id`."""
    from worker.jobs.lifecycle import run_training_job

    run_training_job(context(), job_id)


@celery.task(name=TASK_JOIN, ignore_result=True)
def join(payload: dict[str, Any]) -> None:
    """Run one more node of a job on several nodes (a core.gang.GangCall from the worker heading it)."""
    from worker.jobs.gang import join as join_gang

    join_gang(context(), payload)


@celery.task(name=TASK_CLASSIFY, ignore_result=True)
def classify(payload: dict[str, Any]) -> None:
    """Answer one /classify call (a core.protocol.ClassifyTask) on the Redis list the API waits on."""
    from worker.servers.classification import serve_classify

    serve_classify(context(), payload)


@celery.task(name=TASK_EMBED, ignore_result=True)
def embed(payload: dict[str, Any]) -> None:
    """Answer one /v1/embeddings call (a core.embeddings.EmbedTask) on the Redis list the API waits on."""
    from worker.servers.embeddings import serve_embed

    serve_embed(context(), payload)


@celery.task(name=TASK_GENERATE, ignore_result=True, acks_late=False)
def generate(payload: dict[str, Any]) -> None:
    """Serve one generation request (a core.protocol.GenerateTask); many run at once so the batcher has work."""
    from worker.servers.generation import serve

    serve(context(), payload)


@celery.task(name=TASK_BATCH, ignore_result=True, acks_late=True)
def batch(batch_id: str) -> None:
    """Run (or resume, after a redelivery) one /v1/batches batch on this generation worker's engines."""
    from worker.batches.run import run_batch

    run_batch(context(), batch_id)
