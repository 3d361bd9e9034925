"""/v1/embeddings apart from HTTP: check the inputs, find the model, ask an inference worker, shape OpenAI's reply.

The worker answers with little-endian float32 vectors in base64 (compact and exact on the wire); they are passed
through for `encoding_format: base64` (OpenAI's format) and decoded to JSON numbers for `float`. The reply is encoded
in one pass off the event loop (orjson): 2,048 vectors of 384 floats are 8 MB of JSON, which pydantic models built,
validated and dumped on the loop took a third of a second for, holding every other request of the API process.
"""

from __future__ import annotations

import base64
import sys
import time
import uuid
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from redis.asyncio import Redis
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from app.schemas.embeddings import EmbeddingRequest
from app.services.inference import ask_worker
from core.auth import Principal
from core.embeddings import EmbedResult, EmbedTask, resolve_embedding_model
from core.errors import UpstreamFailed, ValidationFailed
from core.pretrained import builtin_aliases
from core.queue import TaskQueue
from core.redis_keys import embed_reply_key
from core.settings import Settings
from core.tasks import TASK_EMBED

Inputs = tuple[list[str] | None, list[list[int]] | None]


def split_inputs(body: EmbeddingRequest, settings: Settings) -> Inputs:
    """(texts, None) or (None, token id lists) from OpenAI's four shapes of `input`; 422 naming the input refused."""
    raw = body.input
    if isinstance(raw, str):
        items: list = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [raw]  # one list of token ids is one input
    else:
        items = list(raw)
    if not items:
        raise ValidationFailed("input", "at least one input")
    if len(items) > settings.max_embedding_inputs:
        raise ValidationFailed("input", f"at most {settings.max_embedding_inputs} inputs per request, "
                               f"got {len(items)}")

    def field(index: int) -> str:  # as the worker names them (worker/engines/encoders/embedder.py)
        return "input" if len(items) == 1 else f"input.{index}"

    limit = settings.max_embedding_input_chars
    for index, item in enumerate(items):
        if len(item) == 0 or (isinstance(item, str) and not item.strip()):
            raise ValidationFailed(field(index), "input is empty")
        if len(item) > limit:
            what = "characters" if isinstance(item, str) else "token ids"
            raise ValidationFailed(field(index), f"input is longer than {limit} {what}")
        if isinstance(item, list) and min(item) < 0:
            raise ValidationFailed(field(index), "token ids must be >= 0")
    # The request's tokens are bounded too (the worker counts them exactly): token ids by count here, text by its
    # bytes, over which no tokenizer makes fewer tokens, so a request that cannot fit is refused before tokenizing.
    tokens = settings.max_embedding_tokens
    if isinstance(items[0], str):
        size = sum(len(item.encode()) for item in items)
        if size > tokens * settings.prompt_bytes_per_token:
            raise ValidationFailed("input", f"the inputs are {size} bytes; a request holds at most {tokens} tokens, "
                                   f"which no tokenizer makes of more than {tokens * settings.prompt_bytes_per_token}")
        return items, None
    if sum(map(len, items)) > tokens:
        raise ValidationFailed("input", f"the inputs are {sum(map(len, items))} token ids; at most {tokens} per "
                               "request")
    return None, items


def check_model(session: Session, settings: Settings, principal: Principal, *, name: str) -> str:
    """The worker's reference for `name`; the session is closed before the worker is asked."""
    try:
        return resolve_embedding_model(session, settings, name=name, tenant=principal.scope,
                                       aliases=builtin_aliases())
    finally:
        session.close()  # do not hold a connection while the worker computes


def _floats(encoded: str) -> list[float]:
    values = array("f")
    values.frombytes(base64.b64decode(encoded))
    if sys.byteorder == "big":  # the wire is little-endian float32, as OpenAI's base64
        values.byteswap()
    return values.tolist()


@dataclass(frozen=True)
class Embedded:
    """What the worker computed: one base64 little-endian float32 vector per input, and the tokens read."""

    vectors: list[str]
    prompt_tokens: int

    def floats(self) -> list[list[float]]:
        """The vectors as numbers (float32 values, exactly)."""
        return [_floats(v) for v in self.vectors]


async def embed(session: Session, settings: Settings, queue: TaskQueue, redis: Redis, principal: Principal,
                body: EmbeddingRequest, disconnected: Callable[[], Awaitable[bool]]) -> Embedded:
    """Embed the inputs on an inference worker (batched there)."""
    texts, token_ids = split_inputs(body, settings)
    reference = await run_in_threadpool(check_model, session, settings, principal, name=body.model)
    timeout = settings.embedding_timeout_s
    task = EmbedTask(request_id=f"emb-{uuid.uuid4().hex}", model=reference, texts=texts, token_ids=token_ids,
                     dimensions=body.dimensions, deadline=time.time() + timeout, tenant=principal.tenant_id)
    result = await ask_worker(redis, queue, task_name=TASK_EMBED, task=task, reply_key=embed_reply_key(task.request_id),
                              reply_type=EmbedResult, timeout=timeout, disconnected=disconnected,
                              per_tenant=settings.inference_per_tenant)
    vectors = result.embeddings or []
    if len(vectors) != len(texts or token_ids or []):
        raise UpstreamFailed(f"the worker returned {len(vectors)} embeddings for {len(texts or token_ids or [])} "
                             "inputs")
    return Embedded(vectors=vectors, prompt_tokens=result.prompt_tokens)


def reply_json(embedded: Embedded, body: EmbeddingRequest) -> bytes:
    """OpenAI's list object (app.schemas.embeddings.EmbeddingList) as JSON bytes; run it in a thread. Encoded a
    vector at a time, so the event loop's thread gets the interpreter between vectors."""
    float_format = body.encoding_format == "float"
    items = (orjson.dumps({"object": "embedding", "index": i, "embedding": _floats(v) if float_format else v})
             for i, v in enumerate(embedded.vectors))
    usage = {"prompt_tokens": embedded.prompt_tokens, "total_tokens": embedded.prompt_tokens}
    return b"".join((b'{"object":"list","data":[', b",".join(items), b'],"model":',
                     orjson.dumps(body.model), b',"usage":', orjson.dumps(usage), b"}"))
