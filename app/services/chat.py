"""/v1/chat/completions and the structured-output fields of both /v1 routes, apart from HTTP.

The chat is sent to the worker as messages; the worker renders them with the model's own chat template
(see worker/servers/chat_plan.py for why there and not here), with the tools and the template's own arguments;
the worker constrains calls to the template's format and splits the answer into content, reasoning and tool calls
(core/tool_calls.py). The request flow is completions.py's.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from sqlalchemy.orm import Session

from app.schemas.chat import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatLogprobs,
    ToolCall,
)
from app.schemas.generation import CompletionUsage
from app.services.completions import (
    Disconnected,
    collect,
    extras,
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
from core.generation_limits import CHAT
from core.protocol import (
    ChatMessage,
    ChatOptions,
    ChoiceOut,
    DoneEvent,
    GenerationEvent,
    SamplingParams,
    TokenEvent,
    ValueBounds,
)
from core.schema_bounds import SchemaBounds, check_schema
from core.settings import Settings
from core.tool_calls import ToolSpecError, check_tool_calls, check_tool_choice, check_tools


class ChatParams(NamedTuple):
    """A chat request as the worker runs it, and the field its token count came in (errors name it)."""

    messages: list[ChatMessage]
    params: SamplingParams
    options: ChatOptions | None
    tokens_field: str


def _refuse_unsupported(body: ChatCompletionRequest) -> None:
    if body.logit_bias:
        raise ValidationFailed("logit_bias", "logit_bias is not supported by this server")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise ValidationFailed(name, f"{name} is not supported; use /generate with repetition_penalty")
    if body.top_logprobs is not None and not body.logprobs:
        raise ValidationFailed("top_logprobs", "top_logprobs needs logprobs: true")


def _messages(body: ChatCompletionRequest) -> list[ChatMessage]:
    messages = []
    for at, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):  # OpenAI's content parts: text only
            if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
                raise ValidationFailed(f"messages.{at}.content", "only text content parts are supported")
            content = "".join(part["text"] for part in content)
        if content is None and not (message.role == "assistant" and message.tool_calls):
            raise ValidationFailed(f"messages.{at}.content", "content is required (only an assistant message "
                                   "with tool_calls may leave it out)")
        if message.tool_calls is not None and message.role != "assistant":
            raise ValidationFailed(f"messages.{at}.tool_calls", "only assistant messages carry tool_calls")
        if (message.role == "tool") != (message.tool_call_id is not None):
            raise ValidationFailed(f"messages.{at}.tool_call_id", "a tool message, and only a tool message, names "
                                   "the tool_call_id it answers")
        try:
            calls = check_tool_calls(message.tool_calls, f"messages.{at}.tool_calls") if message.tool_calls else None
        except ToolSpecError as exc:
            raise ValidationFailed(exc.field, str(exc)) from exc
        role = "system" if message.role == "developer" else message.role  # OpenAI's newer name for system
        messages.append(ChatMessage(role=role, content=content or "", tool_calls=calls,
                                    tool_call_id=message.tool_call_id, name=message.name))
    return messages


def chat_options(body: ChatCompletionRequest, settings: Settings) -> ChatOptions | None:
    """The tools, tool_choice and template arguments the worker renders and constrains by; None when none.

    Each tool's parameters is a JSON schema the worker compiles into the calls' grammar, so it is held to the same
    bounds as response_format's, and its calls' open strings and numbers to the same lengths. A structured-output
    format beside the tools constrains the answer when it is not calls (core/tool_grammar.py)."""
    try:
        tools = check_tools(body.tools) if body.tools is not None else None
        choice = check_tool_choice(body.tool_choice, tools)
    except ToolSpecError as exc:
        raise ValidationFailed(exc.field, str(exc)) from exc
    for at, tool in enumerate(tools or []):
        check_schema(tool["function"]["parameters"], f"tools.{at}.function.parameters", SchemaBounds.of(settings))
    if choice == "none" and body.parallel_tool_calls is not None and not tools:
        raise ValidationFailed("parallel_tool_calls", "parallel_tool_calls needs tools")
    if tools is None and not body.chat_template_kwargs:
        return None
    return ChatOptions(tools=tools, tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls is not False,
                       template_kwargs=body.chat_template_kwargs or {},
                       tool_bounds=ValueBounds.of(settings) if tools else None)


def chat_params(body: ChatCompletionRequest, settings: Settings) -> ChatParams:
    """Map OpenAI's chat fields onto the messages, SamplingParams and chat options; refuse what cannot be honoured."""
    _refuse_unsupported(body)
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise ValidationFailed("max_tokens", "max_tokens and max_completion_tokens disagree; send one")
    max_tokens, tokens_field = CHAT.chosen({"max_completion_tokens": body.max_completion_tokens,
                                            "max_tokens": body.max_tokens})
    stop = body.stop or []  # the schema checked it: a string or up to 4 strings, as a list
    constraint = constraint_of(body, settings)
    options = chat_options(body, settings)
    constrained = constraint is not None or (options is not None and options.tool_choice != "none")
    params = sampling(max_new_tokens=max_tokens,
                      temperature=1.0 if body.temperature is None else body.temperature,
                      top_p=1.0 if body.top_p is None else body.top_p, stop=stop,
                      seed=body.seed, n=body.n or 1, logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                      constraint=constraint, **extras(body, max_tokens, constrained))
    return ChatParams(_messages(body), params, options, tokens_field)


def message_of(choice: ChoiceOut) -> AssistantMessage:
    """The wire choice as OpenAI's assistant message: content, tool calls and reasoning."""
    calls = [ToolCall.model_validate(c) for c in choice.tool_calls] if choice.tool_calls else None
    return AssistantMessage(content=choice.text if choice.text or not calls else None, tool_calls=calls,
                            reasoning_content=choice.reasoning)


def chat_reason(reason: str | None) -> str | None:
    """A chat choice's finish_reason as OpenAI names it."""
    return "tool_calls" if reason == "tool_calls" else openai_reason(reason)


async def chat(gateway: GenerationGateway, session: Session, principal: Principal, body: ChatCompletionRequest,
               disconnected: Disconnected) -> ChatCompletion | AsyncIterator[bytes]:
    """/v1/chat/completions: a ChatCompletion, or (stream) its chunks as SSE."""
    messages, params, options, tokens_field = chat_params(body, gateway.settings)
    started = await start(gateway, session, principal, body.model, "", params, messages, options,
                          tokens_field=tokens_field)
    completion_id, created = f"chatcmpl-{started.request_id.removeprefix('gen-')}", int(time.time())
    with_logprobs = params.logprobs is not None
    if not body.stream:
        done = await collect(gateway, started, disconnected)
        return ChatCompletion(
            id=completion_id, created=created, model=body.model, usage=CompletionUsage(**done.usage.openai()),
            choices=[ChatChoice(index=c.index, message=message_of(c),
                                logprobs=ChatLogprobs(content=c.logprobs or []) if with_logprobs else None,
                                finish_reason=chat_reason(c.finish_reason))  # type: ignore[arg-type]
                     for c in done.choices])
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    opened: set[int] = set()

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        extra = {"usage": usage} if include_usage else {}
        return sse({"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": body.model,
                    "choices": choices, **extra})

    def choice(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> dict[str, Any]:
        if index not in opened:  # a choice's first chunk names the role, as OpenAI's do
            opened.add(index)
            delta = {"role": "assistant", **delta}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def render(event: GenerationEvent) -> list[bytes]:
        if isinstance(event, TokenEvent):
            logprobs = {"content": [e.model_dump() for e in event.logprobs or []]} if with_logprobs else None
            delta: dict[str, Any] = {"content": event.text} if event.text or not (
                event.reasoning or event.tool_calls) else {}
            if event.reasoning:
                delta["reasoning_content"] = event.reasoning
            if event.tool_calls:
                delta["tool_calls"] = event.tool_calls
            return [chunk([choice(event.index, delta, logprobs)])]
        if not isinstance(event, DoneEvent):
            return []
        out = [chunk([choice(c.index, {}, finish=chat_reason(c.finish_reason))]) for c in event.choices]
        if include_usage:
            out.append(chunk([], event.usage.openai()))
        return out

    return relay(gateway, started, render)
