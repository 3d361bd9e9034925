"""Generation on a worker: one engine per model per process, events to Redis streams as tokens come."""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

from core.redis_client import redis_from_url
from core.settings import get_settings
from core.tasks import cancel_key, stream_key

log = logging.getLogger(__name__)

_engines: dict[str, Any] = {}
_engines_lock = threading.Lock()
_redis: Any = None


def engine_for(model: str) -> Any:
    """The process's engine for `model`, loaded on first use and kept warm."""
    from worker.engines.generation import GenerationEngine

    with _engines_lock:
        engine = _engines.get(model)
        if engine is None:
            settings = get_settings()
            engine = GenerationEngine(model, device=settings.worker_device, max_batch_size=settings.max_batch_size,
                                      max_queue=settings.generation_queue_per_model * 4)
            _engines[model] = engine
        return engine


def redis_client() -> Any:
    """One Redis client (with its pool) per process, shared by the task threads and the scheduler thread."""
    global _redis
    if _redis is None:
        _redis = redis_from_url(get_settings().resolved_redis_url, socket_timeout=10)
    return _redis


class EventWriter:
    """Appends a request's events to its stream; the stream expires once the API no longer needs it."""

    def __init__(self, client: Any, request_id: str, ttl_s: int) -> None:
        self.client = client
        self.key = stream_key(request_id)
        self.cancel = cancel_key(request_id)
        self.ttl_s = ttl_s
        self._checked = 0.0
        self._cancelled = False

    def emit(self, event: dict[str, Any]) -> None:
        self.client.xadd(self.key, {"data": json.dumps(event)})
        if event["type"] in ("accepted", "done", "error"):
            self.client.expire(self.key, self.ttl_s)

    def error(self, code: str, message: str, field: str | None = None) -> None:
        self.emit({"type": "error", "error": {"code": code, "message": message, "field": field}})

    def is_cancelled(self) -> bool:
        """Polled by the engine between decode steps; Redis is asked at most five times a second."""
        now = time.monotonic()
        if not self._cancelled and now - self._checked > 0.2:
            self._checked = now
            self._cancelled = bool(self.client.exists(self.cancel))
        return self._cancelled


def serve(payload: dict[str, Any]) -> None:
    """Run one request from the API end to end; every outcome is written to its event stream."""
    from worker.engines.generation import DeadlineExceeded, QueueFull, SamplingParams

    settings = get_settings()
    writer = EventWriter(redis_client(), payload["request_id"],
                         int(settings.generation_wait_s + settings.generation_timeout_s))
    remaining = float(payload["deadline"]) - time.time()
    if remaining <= 0:  # waited in the broker too long: drop it before it reaches the model
        writer.error("queue_timeout", "the request waited too long for a generation worker; retry")
        return
    params = payload["params"]
    try:
        engine = engine_for(payload["model"])
        prompt_ids = engine.encode(params["prompt"])
        if not prompt_ids:
            writer.error("validation_error", "the prompt encodes to no tokens", "prompt")
            return
        if len(prompt_ids) + params["max_new_tokens"] > engine.context_length:
            writer.error("validation_error", f"the prompt has {len(prompt_ids)} tokens; with max_new_tokens "
                         f"{params['max_new_tokens']} that exceeds the model's context of {engine.context_length}",
                         "max_new_tokens")
            return
        sampling = SamplingParams(max_new_tokens=params["max_new_tokens"], temperature=params["temperature"],
                                  top_k=params["top_k"], top_p=params["top_p"],
                                  repetition_penalty=params["repetition_penalty"], stop=tuple(params["stop"]),
                                  seed=params["seed"], n=params["n"])
        future: Future[Any] = engine.submit(
            prompt_ids, sampling, request_id=payload["request_id"],
            on_token=lambda index, text: writer.emit({"type": "token", "index": index, "text": text}),
            is_cancelled=writer.is_cancelled, deadline=time.monotonic() + remaining)
    except QueueFull as exc:
        writer.error("overloaded", str(exc))
        return
    except ValueError as exc:
        writer.error("validation_error", str(exc))
        return
    except Exception as exc:  # noqa: BLE001 - model failed to load, etc.: the client gets a clear error event
        log.exception("generation request %s failed", payload["request_id"])
        writer.error("worker_error", f"{type(exc).__name__}: {exc}")
        return
    writer.emit({"type": "accepted", "prompt_tokens": len(prompt_ids)})
    try:
        result = future.result(timeout=settings.generation_timeout_s)
    except DeadlineExceeded:
        writer.error("queue_timeout", "the request waited too long for a batch slot; retry")
        return
    except Exception as exc:  # noqa: BLE001
        log.exception("generation request %s failed", payload["request_id"])
        writer.error("worker_error", f"{type(exc).__name__}: {exc}")
        return
    writer.emit({"type": "done",
                 "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason}
                             for c in result.choices],
                 "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens}})
