"""Text generation: /generate (with SSE streaming) and the OpenAI-compatible /v1 routes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from app.deps import PrincipalDep, SessionDep
from app.errors import ERROR_RESPONSES
from app.schemas.chat import ChatCompletion, ChatCompletionRequest
from app.schemas.generation import Completion, CompletionRequest, GenerateRequest, GenerateResponse, ModelList
from app.services import chat as chat_service
from app.services import completions as service
from app.services.generation import GenerationGateway, list_models_for

router = APIRouter(tags=["generation"], responses=ERROR_RESPONSES)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
STREAM_DOC: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or server-sent events when stream is true"}}


def get_gateway(request: Request) -> GenerationGateway:
    """The process's generation gateway."""
    gateway: GenerationGateway = request.app.state.generation
    return gateway


GatewayDep = Annotated[GenerationGateway, Depends(get_gateway)]


def _respond(result: Any) -> Any:
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)
    return result


@router.post("/generate", response_model=GenerateResponse, responses=STREAM_DOC)
async def generate(body: GenerateRequest, request: Request, session: SessionDep, principal: PrincipalDep,
                   gateway: GatewayDep) -> Any:
    """Complete a prompt with a served causal LM; `stream: true` sends one SSE event per token."""
    return _respond(await service.generate(gateway, session, principal, body, request.is_disconnected))


@router.post("/v1/completions", response_model=Completion, responses=STREAM_DOC)
async def completions(body: CompletionRequest, request: Request, session: SessionDep, principal: PrincipalDep,
                   gateway: GatewayDep) -> Any:
    """OpenAI-compatible completions (official clients work unchanged; the API key is a trainserve key)."""
    return _respond(await service.complete(gateway, session, principal, body, request.is_disconnected))


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=STREAM_DOC)
async def chat_completions(body: ChatCompletionRequest, request: Request, session: SessionDep,
                           principal: PrincipalDep, gateway: GatewayDep) -> Any:
    """OpenAI-compatible chat completions through the model's own chat template; logprobs and response_format."""
    return _respond(await chat_service.chat(gateway, session, principal, body, request.is_disconnected))


@router.get("/v1/models", response_model=ModelList)
def list_models(request: Request, session: SessionDep, principal: PrincipalDep) -> ModelList:
    """Models /generate and /v1/completions can serve to this caller."""
    return list_models_for(session, request.app.state.settings, principal)
