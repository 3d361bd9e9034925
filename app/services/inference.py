"""Ask an inference worker and wait for its reply on a Redis list, holding no thread (/classify, /v1/embeddings).

When the caller gives up (timeout, disconnect, lost Redis, cancellation) the task is marked abandoned (a worker
that picks it up skips it before loading any model) and revoked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool

from app.errors import from_wire
from app.redis_window import take
from core.embeddings import ClassifyResult, ClassifyTask, EmbedResult, EmbedTask
from core.errors import BrokerUnavailable, ClientGone, TooManyRequests, WorkerTimeout
from core.logs import task_headers
from core.protocol import ErrorCode
from core.queue import TaskQueue
from core.redis_keys import abandoned_key, inference_key
from core.tasks import QUEUE_INFERENCE

# Longest single blocking read: between reads the caller's connection is checked, and it stays well below
# the Redis client's socket timeout.
BLOCK_S = 1.0
Task = TypeVar("Task", ClassifyTask, EmbedTask)
Reply = TypeVar("Reply", ClassifyResult, EmbedResult)


async def ask_worker(redis: Redis, queue: TaskQueue, *, task_name: str, task: Task, reply_key: str,
                     reply_type: type[Reply], timeout: float, disconnected: Callable[[], Awaitable[bool]],
                     per_tenant: int | None = None) -> Reply:
    """Send `task` to the inference queue and return the worker's reply; its error as the domain error, and
    WorkerTimeout after `timeout` s. With `per_tenant`, 429 overloaded while the task's tenant already has that
    many requests in flight (its share of the queue, across API processes)."""
    key = inference_key(task.tenant)
    if per_tenant is not None:
        try:
            taken = await take(redis, key, member=task.request_id, now=time.time(), horizon=timeout + 60,
                               limit=per_tenant)
        except RedisError as exc:
            raise BrokerUnavailable(f"broker unavailable: {type(exc).__name__}") from exc
        if taken is not None:
            raise TooManyRequests(f"{per_tenant} inference requests of this tenant are in flight; retry when one "
                                  "ends", retry_after=1, code=ErrorCode.OVERLOADED)
    try:
        raw = await _ask(redis, queue, task_name=task_name, payload=task.model_dump(mode="json"),
                         request_id=task.request_id, reply_key=reply_key, timeout=timeout, disconnected=disconnected)
    finally:
        if per_tenant is not None:
            await asyncio.shield(_leave(redis, key, task.request_id))
    reply = reply_type.model_validate_json(raw)
    if reply.error is not None:
        raise from_wire(reply.error)
    return reply


async def _ask(redis: Redis, queue: TaskQueue, *, task_name: str, payload: dict[str, Any], request_id: str,
               reply_key: str, timeout: float, disconnected: Callable[[], Awaitable[bool]]) -> bytes:
    task_id = await run_in_threadpool(queue.send, task_name, [payload], queue=QUEUE_INFERENCE,
                                      headers=task_headers())
    reply: bytes | None = None
    try:
        reply = await _wait(redis, reply_key, time.monotonic() + timeout, disconnected)
    except RedisError as exc:
        raise BrokerUnavailable(f"lost the broker: {type(exc).__name__}") from exc
    finally:
        if reply is None:  # timed out, client gone, lost Redis, or cancelled: nobody will read a result
            await _give_up(redis, queue, request_id, task_id)
    if reply is None:
        raise WorkerTimeout(f"no worker answered within {timeout:g} s")
    return reply


async def _wait(redis: Redis, key: str, deadline: float, disconnected: Callable[[], Awaitable[bool]]) -> bytes | None:
    while (remaining := deadline - time.monotonic()) > 0:
        popped = await redis.blpop([key], timeout=min(remaining, BLOCK_S))  # type: ignore[misc]
        if popped is not None:
            return bytes(popped[1])
        if await disconnected():
            raise ClientGone("the client disconnected")
    return None


async def _leave(redis: Redis, key: str, member: str) -> None:
    try:
        await redis.zrem(key, member)
    except RedisError:
        pass  # the entry ages out of the window


async def _give_up(redis: Redis, queue: TaskQueue, request_id: str, task_id: str) -> None:
    """Mark the task abandoned (a worker that picks it up skips it) and revoke it; survives cancellation."""

    async def give_up() -> None:
        try:
            await redis.set(abandoned_key(request_id), "1", ex=3600)
        except RedisError:
            pass  # the worker still skips it once the deadline has passed
        await run_in_threadpool(queue.revoke, task_id)

    await asyncio.shield(asyncio.ensure_future(give_up()))
