"""Classification on an inference worker: one task per /classify call, the reply pushed to a Redis list.

A task whose caller has given up (the API set its abandoned marker, or the deadline passed) is skipped
before any model is touched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

from pydantic import ValidationError

from core.embeddings import ClassifyResult, ClassifyTask, EmbedResult, EmbedTask, Prediction
from core.protocol import ErrorBody, ErrorCode
from core.redis_keys import abandoned_key, classify_reply_key
from worker.context import WorkerContext
from worker.model_store import fetch_model
from worker.servers.fair_turns import Abandoned, FairTurns

log = logging.getLogger(__name__)


def _classifiers(ctx: WorkerContext) -> Any:
    from worker.engines.encoders.classifier import ClassifierCache

    return ClassifierCache(device=ctx.settings.worker_device)


def classify_texts(ctx: WorkerContext, job_id: str, texts: list[str],
                   turn: Callable[[], AbstractContextManager[Any]] = nullcontext) -> list[dict[str, Any]]:
    """Predictions from a finished job's model: fetched from the store once per host, loaded once per process."""
    model_dir = fetch_model(ctx.storage, job_id)
    classifier = ctx.service("classifiers", _classifiers).get(model_dir)
    result: list[dict[str, Any]] = classifier.predict(
        texts, ctx.settings.inference_batch_size, ctx.settings.inference_turn_tokens, turn=turn)
    return result


def turns_for(ctx: WorkerContext, task: ClassifyTask | EmbedTask) -> Callable[[], AbstractContextManager[Any]]:
    """The task's turns at the process's model, shared round robin over tenants; its batches are dropped
    (Abandoned) once its caller has gone."""
    turns = ctx.service("inference_turns", lambda _: FairTurns())
    return lambda: turns.turn(task.tenant, gone=lambda: abandoned(ctx, task))


def abandoned(ctx: WorkerContext, task: ClassifyTask | EmbedTask) -> bool:
    """True when the caller has stopped waiting for this task."""
    return task.deadline <= time.time() or bool(ctx.redis.exists(abandoned_key(task.request_id)))


def push_reply(ctx: WorkerContext, key: str, reply: str, deadline: float) -> None:
    """Push a reply to the list its caller waits on; it expires if the caller never reads it."""
    ttl = max(1, int(deadline - time.time()) + 60)
    with ctx.redis.pipeline() as pipe:  # one round trip
        pipe.rpush(key, reply)
        pipe.expire(key, ttl)
        pipe.execute()


Task = TypeVar("Task", ClassifyTask, EmbedTask)


def serve_request(ctx: WorkerContext, payload: dict[str, Any], *, task_type: type[Task],
                  answer: Callable[[Task], ClassifyResult | EmbedResult], reply_key: Callable[[str], str]) -> str:
    """Validate a synchronous inference task, skip it if abandoned, answer it (an exception becomes the reply's
    error) and push the reply; returns "skipped", "answered" or "failed"."""
    what = task_type.__name__
    try:
        task = task_type.model_validate(payload)
    except ValidationError:
        log.exception("dropping a malformed %s", what)
        return "failed"
    if abandoned(ctx, task):
        log.info("skipping %s %s: its caller has given up", what, task.request_id)
        return "skipped"
    try:
        result = answer(task)
    except Abandoned:
        log.info("dropping the rest of %s %s: its caller has given up", what, task.request_id)
        return "skipped"
    except Exception as exc:  # noqa: BLE001 - the caller gets the error instead of waiting for its timeout
        log.exception("%s %s failed", what, task.request_id)
        error = ErrorBody(code=ErrorCode.WORKER_ERROR, message=f"worker failed: {exc}")
        result = ClassifyResult(error=error) if task_type is ClassifyTask else EmbedResult(error=error)
    push_reply(ctx, reply_key(task.request_id), result.model_dump_json(), task.deadline)
    return "failed" if result.error else "answered"


def serve_classify(ctx: WorkerContext, payload: dict[str, Any]) -> str:
    """Run one /classify task and push its result; returns "skipped", "answered" or "failed"."""

    def answer(task: ClassifyTask) -> ClassifyResult:
        predictions = classify_texts(ctx, task.job_id, task.texts, turn=turns_for(ctx, task))
        return ClassifyResult(predictions=[Prediction(**p) for p in predictions])

    return serve_request(ctx, payload, task_type=ClassifyTask, answer=answer, reply_key=classify_reply_key)
