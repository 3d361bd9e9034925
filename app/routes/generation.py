"""Text generation: /generate (with SSE streaming) and the OpenAI-compatible /v1 routes."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from app.deps import PrincipalDep, SessionDep
from app.errors import ERROR_RESPONSES
from app.schemas.generation import (
    Completion,
    CompletionChoice,
    CompletionRequest,
    CompletionUsage,
    GenerateRequest,
    GenerateResponse,
    ModelCard,
    ModelList,
)
from app.services.generation import GenerationGateway, GenerationParams, raise_event_error
from core.auth import Principal
from core.errors import ValidationFailed
from core.served_models import ServedModel, list_served_models

router = APIRouter(tags=["generation"], responses=ERROR_RESPONSES)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
STREAM_DOC: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or server-sent events when stream is true"}}


def get_gateway(request: Request) -> GenerationGateway:
    """The process's generation gateway."""
    gateway: GenerationGateway = request.app.state.generation
    return gateway


GatewayDep = Annotated[GenerationGateway, Depends(get_gateway)]


def _sse(data: Any, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data)
    return ((f"event: {event}\n" if event else "") + f"data: {payload}\n\n").encode()


async def _start(gateway: GenerationGateway, session: Any, principal: Principal, name: str,
                 params: GenerationParams) -> tuple[str, ServedModel, AsyncIterator[dict[str, Any]]]:
    """Validate, admit, hand off; returns once the worker accepted the request (or raises its error)."""
    gateway.check(params)
    model = await run_in_threadpool(gateway.resolve, session, principal, name)
    await run_in_threadpool(session.close)  # no connection held while generating
    request_id = await gateway.admit(principal, model)
    finished = False
    try:
        await gateway.submit(request_id, model, params)
        events = gateway.events(request_id)
        first = await anext(events)
        if first["type"] == "error":
            finished = True
            raise_event_error(first)
    except BaseException:
        await gateway.release(request_id, model, finished=finished)
        raise
    return request_id, model, events


async def _collect(gateway: GenerationGateway, request_id: str, model: ServedModel,
                   events: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    finished = False
    try:
        async for event in events:
            if event["type"] == "error":
                finished = True
                raise_event_error(event)
            if event["type"] == "done":
                finished = True
                return event
        raise RuntimeError("event stream ended without a result")
    finally:
        await gateway.release(request_id, model, finished=finished)


async def _stream(gateway: GenerationGateway, request_id: str, model: ServedModel,
                  events: AsyncIterator[dict[str, Any]], render: Callable[[dict[str, Any]], list[bytes]]
                  ) -> AsyncIterator[bytes]:
    """Relay events as SSE; a client that goes away cancels this generator, which frees the batch slot."""
    finished = False
    try:
        async for event in events:
            if event["type"] == "error":
                finished = True
                yield _sse({"error": event["error"]}, event="error")
                break
            for chunk in render(event):
                yield chunk
            if event["type"] == "done":
                finished = True
                break
        yield _sse("[DONE]")
    finally:
        await gateway.release(request_id, model, finished=finished)


def _params(body: GenerateRequest) -> GenerationParams:
    return GenerationParams(prompt=body.prompt, max_new_tokens=body.max_new_tokens, temperature=body.temperature,
                            top_k=body.top_k, top_p=body.top_p, repetition_penalty=body.repetition_penalty,
                            stop=body.stop, seed=body.seed, n=body.n)


@router.post("/generate", response_model=GenerateResponse, responses=STREAM_DOC)
async def generate(body: GenerateRequest, session: SessionDep, principal: PrincipalDep,
                   gateway: GatewayDep) -> Any:
    """Complete a prompt with a served causal LM; `stream: true` sends one SSE event per token."""
    request_id, model, events = await _start(gateway, session, principal, body.model, _params(body))
    if not body.stream:
        done = await _collect(gateway, request_id, model, events)
        return GenerateResponse(id=request_id, model=body.model, choices=done["choices"], usage=done["usage"])

    def render(event: dict[str, Any]) -> list[bytes]:
        if event["type"] == "token":
            return [_sse({"id": request_id, "index": event["index"], "text": event["text"]})]
        if event["type"] == "done":
            return [_sse({"id": request_id, "model": body.model, "choices": event["choices"],
                          "usage": event["usage"]})]
        return []

    return StreamingResponse(_stream(gateway, request_id, model, events, render), media_type="text/event-stream",
                             headers=SSE_HEADERS)


def _openai_params(body: CompletionRequest) -> GenerationParams:
    """Map OpenAI's fields; refuse the ones this server cannot honour instead of silently ignoring them."""
    unsupported = {"echo": body.echo, "logprobs": body.logprobs, "suffix": body.suffix,
                   "logit_bias": body.logit_bias or None}
    for name, value in unsupported.items():
        if value:
            raise ValidationFailed(name, f"{name} is not supported by this server")
    if body.best_of not in (None, 1):
        raise ValidationFailed("best_of", "only best_of=1 is supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise ValidationFailed(name, f"{name} is not supported; use /generate with repetition_penalty")
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1 or not prompts[0]:
        raise ValidationFailed("prompt", "send exactly one non-empty prompt per request")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4 or any(not 1 <= len(s) <= 100 for s in stop):
        raise ValidationFailed("stop", "up to 4 stop sequences of 1-100 characters")
    return GenerationParams(prompt=prompts[0], max_new_tokens=body.max_tokens or 16,
                            temperature=1.0 if body.temperature is None else body.temperature, top_k=0,
                            top_p=1.0 if body.top_p is None else body.top_p, repetition_penalty=1.0, stop=stop,
                            seed=body.seed, n=body.n or 1)


def _openai_reason(reason: str | None) -> str | None:
    return None if reason is None else "length" if reason == "length" else "stop"


@router.post("/v1/completions", response_model=Completion, responses=STREAM_DOC)
async def completions(body: CompletionRequest, session: SessionDep, principal: PrincipalDep,
                      gateway: GatewayDep) -> Any:
    """OpenAI-compatible completions (official clients work unchanged; the API key is a trainserve key)."""
    params = _openai_params(body)
    request_id, model, events = await _start(gateway, session, principal, body.model, params)
    completion_id, created = f"cmpl-{request_id.removeprefix('gen-')}", int(time.time())
    if not body.stream:
        done = await _collect(gateway, request_id, model, events)
        usage = done["usage"]
        return Completion(id=completion_id, created=created, model=body.model,
                          choices=[CompletionChoice(text=c["text"], index=c["index"],
                                                    finish_reason=_openai_reason(c["finish_reason"]))  # type: ignore[arg-type]
                                   for c in done["choices"]],
                          usage=CompletionUsage(prompt_tokens=usage["prompt_tokens"],
                                                completion_tokens=usage["completion_tokens"],
                                                total_tokens=usage["prompt_tokens"] + usage["completion_tokens"]))
    include_usage = bool((body.stream_options or {}).get("include_usage"))

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        return _sse({"id": completion_id, "object": "text_completion", "created": created, "model": body.model,
                     "choices": choices, **({"usage": usage} if usage is not None else {})})

    def render(event: dict[str, Any]) -> list[bytes]:
        if event["type"] == "token":
            return [chunk([{"text": event["text"], "index": event["index"], "logprobs": None,
                            "finish_reason": None}])]
        if event["type"] != "done":
            return []
        out = [chunk([{"text": "", "index": c["index"], "logprobs": None,
                       "finish_reason": _openai_reason(c["finish_reason"])}]) for c in event["choices"]]
        if include_usage:
            usage = event["usage"]
            out.append(chunk([], {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}))
        return out

    return StreamingResponse(_stream(gateway, request_id, model, events, render), media_type="text/event-stream",
                             headers=SSE_HEADERS)


@router.get("/v1/models", response_model=ModelList)
def list_models(request: Request, session: SessionDep, principal: PrincipalDep) -> ModelList:
    """Models /generate and /v1/completions can serve to this caller."""
    models = list_served_models(session, request.app.state.settings, tenant=principal.scope)
    return ModelList(data=[ModelCard(id=m.id, created=m.created, owned_by=m.owned_by) for m in models])
