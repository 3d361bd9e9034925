"""Generation requests: admission (rate limit, bounded queue), hand-off to a worker, events back via Redis."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from app.redis_window import take
from app.schemas.generation import ModelCard, ModelList
from core.auth import Principal
from core.errors import BrokerUnavailable, TooManyRequests, ValidationFailed
from core.generation_limits import server_refusal
from core.logs import task_headers
from core.protocol import (
    ChatMessage,
    ChatOptions,
    ErrorCode,
    ErrorEvent,
    GenerateTask,
    GenerationEvent,
    SamplingParams,
    parse_event,
)
from core.queue import TaskQueue
from core.redis_keys import cancel_key, rate_key, slots_key, stream_key, tenant_slots_key
from core.served_models import ServedModel, list_served_models, resolve_served_model
from core.settings import Settings
from core.store.aliases import list_aliases
from core.tasks import QUEUE_GENERATE, TASK_GENERATE


def check_prompt_bytes(model: ServedModel, size: int, field: str, settings: Settings,
                       what: str | None = None) -> None:
    """Refuse, by its size in bytes, text for `model` that cannot fit its context (a 422 naming `field`, its
    message saying `what` was measured, the field itself when not given): before a worker spends seconds tokenizing
    it (a 960 kB prompt is 200k tokens, 1.5 s of a generation worker's CPU)."""
    if model.context is None:
        return
    bound = model.context * settings.prompt_bytes_per_token
    if size > bound:
        raise ValidationFailed(field, f"the {what or field} is {size} bytes; model {model.id!r} reads at most "
                               f"{model.context} tokens, which no tokenizer makes of more than {bound} bytes")


def check_token_count(model: ServedModel, count: int, field: str) -> None:
    """Refuse (a 422 naming `field`) more token ids than `model` reads."""
    if model.context is not None and count > model.context:
        raise ValidationFailed(field, f"{count} token ids; model {model.id!r} reads at most {model.context} tokens")


class GenerationGateway:
    """One per API process: talks to Redis directly (events, counters) and to workers through the queue."""

    def __init__(self, redis: Redis, queue: TaskQueue, settings: Settings) -> None:
        self.redis = redis
        self.queue = queue
        self.settings = settings
        # Releases run as their own tasks, so a client that goes away cannot cancel them half-way.
        self._releases: set[asyncio.Task[None]] = set()

    def resolve(self, session: Session, principal: Principal, name: str) -> ServedModel:
        """The model to serve, visible to the caller (404 naming `model` otherwise)."""
        return resolve_served_model(session, self.settings, name=name, tenant=principal.scope)

    def check(self, params: SamplingParams, field: str) -> None:
        """The server's limits (core.generation_limits.server_refusal), naming `field`: the request's token field."""
        if (refusal := server_refusal(params, field, self.settings)) is not None:
            raise ValidationFailed(*refusal)

    def check_prompt(self, model: ServedModel, prompt: str, messages: list[ChatMessage] | None,
                     chat: ChatOptions | None = None, *, prompt_ids: list[int] | None = None) -> None:
        """Refuse, by its size in bytes, a prompt that cannot fit the model's context (check_prompt_bytes), or token
        ids (`prompt_ids`, then `field`) more than the context. A chat counts everything its template renders: the
        messages (their tool calls too), the tools and the template's arguments; the error names the largest of
        those fields. Text UTF-8 cannot encode is refused too."""
        if prompt_ids is not None:
            check_token_count(model, len(prompt_ids), "prompt")
            return
        parts = {"prompt": _utf8_bytes(prompt, "prompt")} if messages is None else _chat_bytes(messages, chat)
        size, field = sum(parts.values()), max(parts, key=lambda name: parts[name])
        what = field if messages is None else "chat (" + ", ".join(
            f"{name} {parts[name]}" for name in parts if parts[name]) + ")"
        check_prompt_bytes(model, size, field, self.settings, what=what)

    async def admit(self, principal: Principal, model: ServedModel, rows: int = 1) -> str:
        """Apply the per-key rate limit and the per-model queue bound, in rows (a request of n choices takes n), with
        each tenant's share of it; returns a request id holding its rows."""
        now = time.time()
        request_id = f"gen-{uuid.uuid4().hex}"
        try:
            # Sliding one-minute window per key: a log of request times, so there is no burst at minute edges.
            oldest = await self._take(rate_key(principal.key_id), member=uuid.uuid4().hex, now=now,
                                      horizon=60, limit=self.settings.generation_rate_per_minute)
            if oldest is not None:
                raise TooManyRequests(f"more than {self.settings.generation_rate_per_minute} generation requests "
                                      "per minute for this key", retry_after=max(oldest + 60 - now, 1.0),
                                      code=ErrorCode.RATE_LIMITED)
            await self._take_rows(principal, model, request_id, rows, now)
        except RedisError as exc:
            raise BrokerUnavailable(f"broker unavailable: {type(exc).__name__}") from exc
        return request_id

    async def _take_rows(self, principal: Principal, model: ServedModel, request_id: str, rows: int,
                         now: float) -> None:
        """Hold `rows` of the model's queue and of the tenant's share of it, both or neither (TooManyRequests).

        Work-conserving: a tenant alone on the model may fill its whole queue (generation_queue_per_model rows). While
        another tenant holds rows, each may hold its share (generation_queue_per_tenant), however full the model's
        queue, up to both bounds together in all: a lone tenant's burst never keeps a newcomer out. Slots older than
        the longest possible request are leftovers of a crashed API process. A request of more rows than a tenant's
        share holds the whole share.
        """
        per_model, per_tenant = self.settings.generation_queue_per_model, self.settings.generation_queue_per_tenant
        taken = self._rows_held(rows)
        keys = (slots_key(model.id), tenant_slots_key(model.id, principal.tenant_id))
        args = (str(now), str(self._lifetime()), str(per_model), str(per_tenant), str(int(self._lifetime()) + 1),
                str(taken), request_id)
        full = await self.redis.eval(_TAKE_ROWS, 2, *keys, *args)  # type: ignore[misc]
        if full in (b"model", "model"):
            raise TooManyRequests(f"model {model.id!r} has its whole generation queue in flight ({per_model} rows, "
                                  f"{per_model + per_tenant} while several tenants share it); retry shortly",
                                  retry_after=1, code=ErrorCode.OVERLOADED)
        if full in (b"tenant", "tenant"):
            raise TooManyRequests(f"this tenant has {per_tenant} generation rows in flight on model {model.id!r} "
                                  "(its share of the model's queue); retry shortly", retry_after=1,
                                  code=ErrorCode.OVERLOADED)

    async def _take(self, key: str, *, member: str, now: float, horizon: float, limit: int) -> float | None:
        return await take(self.redis, key, member=member, now=now, horizon=horizon, limit=limit)

    async def submit(self, request_id: str, model: ServedModel, prompt: str, params: SamplingParams,
                     messages: list[ChatMessage] | None = None, *, tokens_field: str, tenant: str | None = None,
                     chat: ChatOptions | None = None, prompt_ids: list[int] | None = None,
                     op: Literal["generate", "tokenize", "detokenize"] = "generate",
                     add_special_tokens: bool = True) -> None:
        """Hand the request of `tenant` to a generation worker; it must start before the wait deadline (`op`: or
        ask only the model's tokenizer, GenerateTask.op)."""
        task = GenerateTask(request_id=request_id, op=op, model=model.path, adapter=model.adapter, tenant=tenant,
                            prompt=prompt, prompt_ids=prompt_ids, params=params, tokens_field=tokens_field,
                            messages=messages, chat=chat, add_special_tokens=add_special_tokens,
                            deadline=time.time() + self.settings.generation_wait_s)
        await run_in_threadpool(self.queue.send, TASK_GENERATE, [task.model_dump(mode="json")], queue=QUEUE_GENERATE,
                                headers=task_headers())

    async def events(self, request_id: str) -> AsyncIterator[GenerationEvent]:
        """The worker's events for this request, in order, until `done`, `tokens` or `error` (or the lifetime ends)."""
        key = stream_key(request_id)
        last = "0-0"
        deadline = time.monotonic() + self._lifetime()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                yield ErrorEvent.of(ErrorCode.WORKER_TIMEOUT, "no generation worker finished the request in time")
                return
            try:
                reply = await self.redis.xread({key: last}, block=int(min(remaining, 1.0) * 1000), count=256)
            except RedisError as exc:
                yield ErrorEvent.of(ErrorCode.BROKER_UNAVAILABLE, f"lost the broker: {type(exc).__name__}")
                return
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    event = parse_event(fields[b"data"])
                    yield event
                    if event.type in ("done", "tokens", "error"):
                        return

    async def release(self, request_id: str, model: ServedModel, *, finished: bool, tenant: str, rows: int = 1
                      ) -> None:
        """Free the queue slot and, unless the worker finished, set the cancel flag; a cancelled caller cannot stop it.

        The work runs in a task of its own; when the caller is cancelled (the client went away) the await below
        is interrupted but the task still completes.
        """
        taken = self._rows_held(rows)
        task = asyncio.ensure_future(self._release(request_id, model, finished=finished, tenant=tenant, rows=taken))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        await asyncio.shield(task)

    async def drain(self) -> None:
        """Wait for releases still in flight (the app's shutdown, before Redis is closed)."""
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)

    async def _release(self, request_id: str, model: ServedModel, *, finished: bool, tenant: str, rows: int) -> None:
        try:
            if not finished:
                await self.redis.set(cancel_key(request_id), "1", ex=int(self._lifetime()))
            for key in (slots_key(model.id), tenant_slots_key(model.id, tenant)):
                await self.redis.zrem(key, *(f"{request_id}#{row}" for row in range(1, rows + 1)))
        except RedisError:
            pass  # the slot expires on its own (see admit)

    def _rows_held(self, rows: int) -> int:
        """Rows a request of `rows` choices holds: a request larger than a tenant's share holds the whole share."""
        return min(rows, self.settings.generation_queue_per_model, self.settings.generation_queue_per_tenant)

    def _lifetime(self) -> float:
        return self.settings.generation_wait_s + self.settings.generation_timeout_s


def _chat_bytes(messages: list[ChatMessage], chat: ChatOptions | None) -> dict[str, int]:
    """The UTF-8 bytes of what a chat template renders, by the request field they came in."""
    size = 0
    for at, message in enumerate(messages):
        for name in ("content", "tool_calls", "name", "tool_call_id"):
            size += _utf8_bytes(getattr(message, name), f"messages.{at}.{name}")
    return {"messages": size, "tools": _utf8_bytes(chat.tools if chat else None, "tools"),
            "chat_template_kwargs": _utf8_bytes(chat.template_kwargs or None if chat else None, "chat_template_kwargs")}


def _utf8_bytes(value: object, field: str) -> int:
    """UTF-8 bytes of a string, or of a JSON value as JSON text (0 for None); a lone surrogate (JSON's "\\ud800"),
    which no UTF-8 text holds, is a 422 naming `field`."""
    if value is None:
        return 0
    try:
        return len((value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)).encode())
    except UnicodeEncodeError as exc:
        raise ValidationFailed(field, "the text holds a lone UTF-16 surrogate, which is not Unicode text") from exc


def list_models_for(session: Session, settings: Settings, principal: Principal) -> ModelList:
    """The models /generate and /v1/completions can serve to this caller."""
    models = list_served_models(session, settings, tenant=principal.scope)
    aliases = [ModelCard(id=a.name, created=int(a.updated_at.timestamp()), owned_by=a.tenant_id, target=a.target)
               for a in list_aliases(session, tenant=principal.scope)]
    return ModelList(data=[ModelCard(id=m.id, created=m.created, owned_by=m.owned_by) for m in models] + aliases)



# KEYS[1]: a model's rows in flight, KEYS[2]: one tenant's rows in flight on that model (sorted sets of
# (member, time)); ARGV: now, horizon, model limit, tenant limit, ttl, rows, request id. Drops entries older than
# the horizon; adds the request's rows (members "<id>#1".."<id>#rows") to both when both have room and returns
# false, else returns which is full ("model" or "tenant").
_TAKE_ROWS = """
local now, horizon, rows = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - horizon)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - horizon)
local total, mine = redis.call('ZCARD', KEYS[1]), redis.call('ZCARD', KEYS[2])
local per_model, per_tenant = tonumber(ARGV[3]), tonumber(ARGV[4])
if total == mine then
  if total + rows > per_model then return 'model' end
else
  if mine + rows > per_tenant then return 'tenant' end
  if total + rows > per_model + per_tenant then return 'model' end
end
for row = 1, rows do
  redis.call('ZADD', KEYS[1], ARGV[1], ARGV[7] .. '#' .. row)
  redis.call('ZADD', KEYS[2], ARGV[1], ARGV[7] .. '#' .. row)
end
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[5])
return false
"""
