"""Predictions from a fine-tuned model, computed on an inference worker that keeps it warm.

The API waits for the worker's reply on a Redis list with the async client, so a waiting call holds no
thread; when it gives up it marks the task abandoned (a worker skips it) and revokes it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from app.errors import from_wire
from core.auth import Principal
from core.errors import BrokerUnavailable, ClientGone, NotFound, ValidationFailed, WorkerTimeout
from core.logs import task_headers
from core.rows import JobStatus, TaskKind
from core.protocol import ClassifyResult, ClassifyTask, Prediction
from core.queue import TaskQueue
from core.redis_keys import abandoned_key, classify_reply_key
from core.settings import Settings
from core.store import jobs as store
from core.tasks import QUEUE_INFERENCE, TASK_CLASSIFY

# Longest single blocking read: between reads the caller's connection is checked, and it stays well below
# the Redis client's socket timeout.
BLOCK_S = 1.0


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
                        deadline=time.time() + timeout)
    task_id = await run_in_threadpool(queue.send, TASK_CLASSIFY, [task.model_dump(mode="json")],
                                      queue=QUEUE_INFERENCE, headers=task_headers())
    reply: bytes | None = None
    try:
        reply = await _wait(redis, classify_reply_key(task.request_id), time.monotonic() + timeout, disconnected)
    except RedisError as exc:
        raise BrokerUnavailable(f"lost the broker: {type(exc).__name__}") from exc
    finally:
        if reply is None:  # timed out, client gone, lost Redis, or cancelled: nobody will read a result
            await _give_up(redis, queue, task, task_id)
    if reply is None:
        raise WorkerTimeout(f"no worker answered within {timeout:g} s")
    result = ClassifyResult.model_validate_json(reply)
    if result.error is not None:
        raise from_wire(result.error)
    return result.predictions or []


async def _wait(redis: Redis, key: str, deadline: float, disconnected: Callable[[], Awaitable[bool]]) -> bytes | None:
    while (remaining := deadline - time.monotonic()) > 0:
        popped = await redis.blpop([key], timeout=min(remaining, BLOCK_S))  # type: ignore[misc]
        if popped is not None:
            return bytes(popped[1])
        if await disconnected():
            raise ClientGone("the client disconnected")
    return None


async def _give_up(redis: Redis, queue: TaskQueue, task: ClassifyTask, task_id: str) -> None:
    """Mark the task abandoned (a worker that picks it up skips it) and revoke it; survives cancellation."""

    async def give_up() -> None:
        try:
            await redis.set(abandoned_key(task.request_id), "1", ex=3600)
        except RedisError:
            pass  # the worker still skips it once the deadline has passed
        await run_in_threadpool(queue.revoke, task_id)

    await asyncio.shield(asyncio.ensure_future(give_up()))
