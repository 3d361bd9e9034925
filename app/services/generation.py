"""Generation requests: admission (rate limit, bounded queue), hand-off to a worker, events back via Redis."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from core.auth import Principal
from core.errors import (
    BrokerUnavailable,
    QueueTimeout,
    TooManyRequests,
    UpstreamFailed,
    ValidationFailed,
    WorkerTimeout,
)
from core.queue import TaskQueue
from core.served_models import ServedModel, resolve_served_model
from core.settings import Settings
from core.tasks import QUEUE_GENERATE, TASK_GENERATE, cancel_key, stream_key


@dataclass(frozen=True)
class GenerationParams:
    """What the worker needs, as plain JSON."""

    prompt: str
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    stop: list[str]
    seed: int | None
    n: int


class GenerationGateway:
    """One per API process: talks to Redis directly (events, counters) and to workers through the queue."""

    def __init__(self, redis: Redis, queue: TaskQueue, settings: Settings) -> None:
        self.redis = redis
        self.queue = queue
        self.settings = settings

    def resolve(self, session: Session, principal: Principal, name: str) -> ServedModel:
        """The model to serve, visible to the caller (404 naming `model` otherwise)."""
        return resolve_served_model(session, self.settings, name=name, tenant=principal.scope)

    def check(self, params: GenerationParams) -> None:
        """Server-side caps that the schema cannot know."""
        if params.max_new_tokens > self.settings.max_new_tokens:
            raise ValidationFailed("max_new_tokens", f"must be at most {self.settings.max_new_tokens} on this server")

    async def admit(self, principal: Principal, model: ServedModel) -> str:
        """Apply the per-key rate limit and the per-model queue bound; returns a request id holding a slot."""
        now = time.time()
        try:
            # Sliding one-minute window per key: a log of request times, so there is no burst at minute edges.
            rate_key = f"trainserve:rate:{principal.key_id}"
            await self.redis.zremrangebyscore(rate_key, "-inf", now - 60)
            if await self.redis.zcard(rate_key) >= self.settings.generation_rate_per_minute:
                oldest = await self.redis.zrange(rate_key, 0, 0, withscores=True)
                wait = (oldest[0][1] + 60 - now) if oldest else 1.0
                raise TooManyRequests(f"more than {self.settings.generation_rate_per_minute} generation requests "
                                      "per minute for this key", retry_after=wait, code="rate_limited")
            await self.redis.zadd(rate_key, {uuid.uuid4().hex: now})
            await self.redis.expire(rate_key, 61)
            request_id = f"gen-{uuid.uuid4().hex}"
            slots = _slots_key(model.id)
            # Slots older than the longest possible request are leftovers of a crashed API process.
            await self.redis.zremrangebyscore(slots, "-inf", now - self._lifetime())
            await self.redis.zadd(slots, {request_id: now})
            if await self.redis.zcard(slots) > self.settings.generation_queue_per_model:
                await self.redis.zrem(slots, request_id)
                raise TooManyRequests(f"model {model.id!r} has {self.settings.generation_queue_per_model} requests "
                                      "in flight; retry shortly", retry_after=1, code="overloaded")
        except RedisError as exc:
            raise BrokerUnavailable(f"broker unavailable: {type(exc).__name__}") from exc
        return request_id

    async def submit(self, request_id: str, model: ServedModel, params: GenerationParams) -> None:
        """Hand the request to a generation worker; it must start before the wait deadline."""
        deadline = time.time() + self.settings.generation_wait_s
        payload = {"request_id": request_id, "model": model.path, "params": params.__dict__, "deadline": deadline}
        await run_in_threadpool(self.queue.send, TASK_GENERATE, [payload], queue=QUEUE_GENERATE)

    async def events(self, request_id: str) -> AsyncIterator[dict[str, Any]]:
        """The worker's events for this request, in order, until `done` or `error` (or the lifetime ends)."""
        key = stream_key(request_id)
        last = "0-0"
        deadline = time.monotonic() + self._lifetime()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                yield {"type": "error", "error": {"code": "worker_timeout", "field": None,
                                                  "message": "no generation worker finished the request in time"}}
                return
            try:
                reply = await self.redis.xread({key: last}, block=int(min(remaining, 1.0) * 1000), count=256)
            except RedisError as exc:
                yield {"type": "error", "error": {"code": "broker_unavailable", "field": None,
                                                  "message": f"lost the broker: {type(exc).__name__}"}}
                return
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    event = json.loads(fields[b"data"])
                    yield event
                    if event["type"] in ("done", "error"):
                        return

    async def release(self, request_id: str, model: ServedModel, *, finished: bool) -> None:
        """Free the queue slot; if the client left early, tell the worker to drop the request."""
        try:
            if not finished:
                await self.redis.set(cancel_key(request_id), "1", ex=int(self._lifetime()))
            await self.redis.zrem(_slots_key(model.id), request_id)
        except RedisError:
            pass  # the slot expires on its own (see admit)

    def _lifetime(self) -> float:
        return self.settings.generation_wait_s + self.settings.generation_timeout_s


def _slots_key(model_id: str) -> str:
    return f"trainserve:slots:{model_id}"


def raise_event_error(event: dict[str, Any]) -> None:
    """Turn a worker's error event into the domain error the API answers with."""
    error = event["error"]
    code, message, field = error.get("code"), error.get("message", "generation failed"), error.get("field")
    if code == "validation_error":
        raise ValidationFailed(field, message)
    if code == "queue_timeout":
        raise QueueTimeout(message)
    if code == "overloaded":
        raise TooManyRequests(message, retry_after=1, code="overloaded")
    if code == "worker_timeout":
        raise WorkerTimeout(message)
    if code == "broker_unavailable":
        raise BrokerUnavailable(message)
    raise UpstreamFailed(message, code=code or "worker_error")
