"""Text generation: /generate (with SSE streaming), the OpenAI-compatible /v1 routes and vLLM's /tokenize and
/detokenize."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from app.deps import PrincipalDep, SessionDep
from app.errors import ERROR_RESPONSES
from app.schemas.chat import ChatCompletion, ChatCompletionRequest
from app.schemas.generation import (
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    GenerateRequest,
    GenerateResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from app.services import chat as chat_service
from app.services import completions as service
from app.services import tokenizer as tokenizer_service
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


def respond(result: Any) -> Any:
    """A service's answer, or its SSE stream as a streaming response."""
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)
    return result


@router.post("/generate", response_model=GenerateResponse, responses=STREAM_DOC)
async def generate(body: GenerateRequest, request: Request, session: SessionDep, principal: PrincipalDep,
                   gateway: GatewayDep) -> Any:
    """Complete a prompt with a served causal LM; `stream: true` sends one SSE event per token."""
    return respond(await service.generate(gateway, session, principal, body, request.is_disconnected))


@router.post("/v1/completions", response_model=Completion, responses=STREAM_DOC)
async def completions(body: CompletionRequest, request: Request, session: SessionDep, principal: PrincipalDep,
                   gateway: GatewayDep) -> Any:
    """OpenAI-compatible completions (official clients work unchanged; the API key is a trainserve key)."""
    return respond(await service.complete(gateway, session, principal, body, request.is_disconnected))


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=STREAM_DOC)
async def chat_completions(body: ChatCompletionRequest, request: Request, session: SessionDep,
                           principal: PrincipalDep, gateway: GatewayDep) -> Any:
    """OpenAI-compatible chat completions through the model's own chat template; logprobs and response_format."""
    return respond(await chat_service.chat(gateway, session, principal, body, request.is_disconnected))


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, session: SessionDep, principal: PrincipalDep,
                   gateway: GatewayDep) -> TokenizeResponse:
    """A served model's token ids of a text (vLLM's /tokenize)."""
    return await tokenizer_service.tokenize(gateway, session, principal, body)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, session: SessionDep, principal: PrincipalDep,
                     gateway: GatewayDep) -> DetokenizeResponse:
    """A served model's text of token ids (vLLM's /detokenize)."""
    return await tokenizer_service.detokenize(gateway, session, principal, body)


@router.get("/v1/models", response_model=ModelList)
def list_models(request: Request, session: SessionDep, principal: PrincipalDep) -> ModelList:
    """Models /generate and /v1/completions can serve to this caller."""
    return list_models_for(session, request.app.state.settings, principal)
