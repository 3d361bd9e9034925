"""The OpenAI-compatible embeddings route."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from app.deps import PrincipalDep, QueueDep, SessionDep, SettingsDep
from app.errors import ERROR_RESPONSES
from app.schemas.embeddings import EmbeddingList, EmbeddingRequest
from app.services import embeddings as service

router = APIRouter(tags=["inference"], responses=ERROR_RESPONSES)


@router.post("/v1/embeddings", response_model=EmbeddingList)
async def create_embeddings(body: EmbeddingRequest, request: Request, session: SessionDep, settings: SettingsDep,
                            queue: QueueDep, principal: PrincipalDep) -> Response:
    """OpenAI-compatible embeddings from a sentence-transformers model or a fine-tuned encoder (batched on an
    inference worker; the API waits without holding a thread). The reply, an EmbeddingList, is encoded in a thread."""
    embedded = await service.embed(session, settings, queue, request.app.state.redis, principal, body,
                                   request.is_disconnected)
    return Response(await run_in_threadpool(service.reply_json, embedded, body), media_type="application/json")
