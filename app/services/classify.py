"""Predictions from a fine-tuned model, computed on an inference worker that keeps it warm.

The API waits for the worker's reply on a Redis list with the async client (app.services.inference), so a
waiting call holds no thread; when it gives up it marks the task abandoned (a worker skips it) and revokes it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from app.services.inference import ask_worker
from core.auth import Principal
from core.embeddings import ClassifyResult, ClassifyTask, Prediction
from core.errors import NotFound, ValidationFailed
from core.queue import TaskQueue
from core.redis_keys import classify_reply_key
from core.rows import JobStatus, TaskKind
from core.settings import Settings
from core.store import jobs as store
from core.tasks import TASK_CLASSIFY


def check_classifier(session: Session, settings: Settings, principal: Principal, *, model: str,
                     texts: list[str]) -> None:
    """The texts are acceptable and `model` is the caller's succeeded classifier (404/422 otherwise)."""
    if len(texts) > settings.max_classify_texts:
        raise ValidationFailed("texts", f"at most {settings.max_classify_texts} texts per request")
    for index, text in enumerate(texts):
        if not text.strip():
            raise ValidationFailed(f"texts.{index}", "text is empty")
    try:
        job = store.get_job(session, job_id=model, tenant=principal.scope)
    except NotFound as exc:
        raise NotFound(f"model {model!r} not found", field="model") from exc
    if job.task != TaskKind.TEXT_CLASSIFICATION:
        raise ValidationFailed("model", f"job {model!r} is a {job.task} job, not a classifier")
    if job.status != JobStatus.SUCCEEDED:
        raise ValidationFailed("model", f"job {model!r} is {job.status}; only succeeded jobs serve predictions")
    session.close()  # do not hold a connection while the worker computes


async def classify(session: Session, settings: Settings, queue: TaskQueue, redis: Redis, principal: Principal, *,
                   model: str, texts: list[str], disconnected: Callable[[], Awaitable[bool]]) -> list[Prediction]:
    """Check the model is a finished classifier, then ask a worker for predictions and wait without a thread."""
    await run_in_threadpool(check_classifier, session, settings, principal, model=model, texts=texts)
    timeout = settings.classify_timeout_s
    task = ClassifyTask(request_id=f"cls-{uuid.uuid4().hex}", job_id=model, texts=texts,
                        deadline=time.time() + timeout, tenant=principal.tenant_id)
    result = await ask_worker(redis, queue, task_name=TASK_CLASSIFY, task=task,
                              reply_key=classify_reply_key(task.request_id), reply_type=ClassifyResult,
                              timeout=timeout, disconnected=disconnected, per_tenant=settings.inference_per_tenant)
    return result.predictions or []
