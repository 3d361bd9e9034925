"""Embeddings on an inference worker: one task per /v1/embeddings call, batched inside it, the reply on a Redis list.

As with /classify, a task whose caller has given up is skipped before any model is touched.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from core.embeddings import EmbedResult, EmbedTask
from core.pretrained import builtin_aliases
from core.protocol import ErrorBody, ErrorCode
from core.redis_keys import embed_reply_key
from core.served_models import is_job_model
from worker.context import WorkerContext
from worker.model_store import fetch_model
from worker.servers.classification import serve_request, turns_for


def _embedders(ctx: WorkerContext) -> Any:
    from worker.engines.encoders.classifier import ClassifierCache
    from worker.engines.encoders.embedder import Embedder

    return ClassifierCache(device=ctx.settings.worker_device, load=Embedder)


def model_folder(ctx: WorkerContext, reference: str) -> Path:
    """The local folder of an EmbedTask's model: a job's model (fetched once per host), an alias, or a folder."""
    if is_job_model(reference):
        return fetch_model(ctx.storage, reference)
    aliases = builtin_aliases()
    return aliases[reference] if reference in aliases else Path(reference)


def embedder_for(ctx: WorkerContext, reference: str) -> Any:
    """The process's Embedder (worker.engines.encoders.embedder) for an EmbedTask's model (loaded on first use)."""
    return ctx.service("embedders", _embedders).get(model_folder(ctx, reference))


def embed(ctx: WorkerContext, task: EmbedTask) -> EmbedResult:
    """The task's vectors (little-endian float32, base64) and token count; refusals name the request field."""
    from worker.engines.encoders.embedder import EmbeddingRefused

    embedder = embedder_for(ctx, task.model)
    try:
        turn = turns_for(ctx, task)
        ids = embedder.tokenize(task.texts, task.token_ids, turn=turn)
        tokens, bound = sum(map(len, ids)), ctx.settings.max_embedding_tokens
        if tokens > bound:
            raise EmbeddingRefused("input", f"the inputs are {tokens} tokens; at most {bound} per request")
        vectors = embedder.embed(ids, task.dimensions, batch_size=ctx.settings.inference_batch_size,
                                 turn_tokens=ctx.settings.inference_turn_tokens, turn=turn)
    except EmbeddingRefused as exc:
        return EmbedResult(error=ErrorBody(code=ErrorCode.VALIDATION_ERROR, message=str(exc), field=exc.field))
    little = vectors.astype("<f4", copy=False)
    return EmbedResult(embeddings=[base64.b64encode(row.tobytes()).decode("ascii") for row in little],
                       dimensions=int(little.shape[1]), prompt_tokens=sum(len(row) for row in ids))


def serve_embed(ctx: WorkerContext, payload: dict[str, Any]) -> str:
    """Run one /v1/embeddings task and push its result; returns "skipped", "answered" or "failed"."""
    return serve_request(ctx, payload, task_type=EmbedTask, answer=lambda task: embed(ctx, task),
                         reply_key=embed_reply_key)
