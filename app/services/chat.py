"""/v1/chat/completions and the structured-output fields of both /v1 routes, apart from HTTP.

The chat is sent to the worker as messages; the worker renders them with the model's own chat template
(see worker/serving.render_chat for why there and not here). The request flow is completions.py's.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy.orm import Session

from app.schemas.chat import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatLogprobs,
)
from app.schemas.generation import CompletionUsage
from app.services.completions import (
    Disconnected,
    collect,
    openai_reason,
    relay,
    sampling,
    sse,
    start,
)
from app.services.generation import GenerationGateway
from app.services.structured import constraint_of
from core.auth import Principal
from core.errors import ValidationFailed
from core.protocol import ChatMessage, DoneEvent, GenerationEvent, SamplingParams, TokenEvent

DEFAULT_MAX_TOKENS = 256


def _refuse_unsupported(body: ChatCompletionRequest) -> None:
    unsupported = {"tools": body.tools, "tool_choice": body.tool_choice, "logit_bias": body.logit_bias,
                   "parallel_tool_calls": body.parallel_tool_calls}
    for name, value in unsupported.items():
        if value:
            raise ValidationFailed(name, f"{name} is not supported by this server")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise ValidationFailed(name, f"{name} is not supported; use /generate with repetition_penalty")
    if body.top_logprobs is not None and not body.logprobs:
        raise ValidationFailed("top_logprobs", "top_logprobs needs logprobs: true")


def _messages(body: ChatCompletionRequest) -> list[ChatMessage]:
    messages = []
    for at, message in enumerate(body.messages):
        content = message.content
        if not isinstance(content, str):  # OpenAI's content parts: text only
            if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
                raise ValidationFailed(f"messages.{at}.content", "only text content parts are supported")
            content = "".join(part["text"] for part in content)
        role = "system" if message.role == "developer" else message.role  # OpenAI's newer name for system
        messages.append(ChatMessage(role=role, content=content))
    return messages


def chat_params(body: ChatCompletionRequest) -> tuple[list[ChatMessage], SamplingParams]:
    """Map OpenAI's chat fields onto the messages and SamplingParams; refuse what cannot be honoured."""
    _refuse_unsupported(body)
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise ValidationFailed("max_tokens", "max_tokens and max_completion_tokens disagree; send one")
    stop = body.stop or []  # the schema checked it: a string or up to 4 strings, as a list
    params = sampling(max_new_tokens=body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS,
                      temperature=1.0 if body.temperature is None else body.temperature, top_k=0,
                      top_p=1.0 if body.top_p is None else body.top_p, repetition_penalty=1.0, stop=stop,
                      seed=body.seed, n=body.n or 1, logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                      constraint=constraint_of(body))
    return _messages(body), params


async def chat(gateway: GenerationGateway, session: Session, principal: Principal, body: ChatCompletionRequest,
               disconnected: Disconnected) -> ChatCompletion | AsyncIterator[bytes]:
    """/v1/chat/completions: a ChatCompletion, or (stream) its chunks as SSE."""
    messages, params = chat_params(body)
    started = await start(gateway, session, principal, body.model, "", params, messages)
    completion_id, created = f"chatcmpl-{started.request_id.removeprefix('gen-')}", int(time.time())
    with_logprobs = params.logprobs is not None
    if not body.stream:
        done = await collect(gateway, started, disconnected)
        return ChatCompletion(
            id=completion_id, created=created, model=body.model, usage=CompletionUsage(**done.usage.openai()),
            choices=[ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                                logprobs=ChatLogprobs(content=c.logprobs or []) if with_logprobs else None,
                                finish_reason=openai_reason(c.finish_reason))  # type: ignore[arg-type]
                     for c in done.choices])
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    opened: set[int] = set()

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        extra = {"usage": usage} if include_usage else {}
        return sse({"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": body.model,
                    "choices": choices, **extra})

    def choice(index: int, delta: dict[str, str], logprobs: Any = None, finish: str | None = None) -> dict[str, Any]:
        if index not in opened:  # a choice's first chunk names the role, as OpenAI's do
            opened.add(index)
            delta = {"role": "assistant", **delta}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def render(event: GenerationEvent) -> list[bytes]:
        if isinstance(event, TokenEvent):
            logprobs = {"content": [e.model_dump() for e in event.logprobs or []]} if with_logprobs else None
            return [chunk([choice(event.index, {"content": event.text}, logprobs)])]
        if not isinstance(event, DoneEvent):
            return []
        out = [chunk([choice(c.index, {}, finish=openai_reason(c.finish_reason))]) for c in event.choices]
        if include_usage:
            out.append(chunk([], event.usage.openai()))
        return out

    return relay(gateway, started, render)
