"""The serving side of /generate and /v1/completions, apart from HTTP (as vLLM keeps its OpenAI layer).

Request flow (admit, hand off, wait for the first event, collect or relay), OpenAI parameter mapping,
response and chunk building and SSE rendering live here; the routes only parse, call and return.
Releasing a request's slot survives a client that goes away (see GenerationGateway.release).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from pydantic import ValidationError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from app.errors import error_body, from_wire
from app.schemas.generation import (
    Completion,
    CompletionChoice,
    CompletionRequest,
    CompletionUsage,
    GenerateRequest,
    GenerateResponse,
    LegacyLogprobs,
    SamplingExtras,
)
from app.services.generation import GenerationGateway
from app.services.structured import constraint_of
from app.sse import sse_message
from core.auth import Principal
from core.errors import ClientGone, ValidationFailed
from core.generation_limits import COMPLETIONS, GENERATE
from core.protocol import (
    AcceptedEvent,
    ChatMessage,
    ChatOptions,
    DoneEvent,
    ErrorBody,
    ErrorEvent,
    GenerationEvent,
    PromptLogprobs,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from core.served_models import ServedModel
from core.settings import Settings

# How often a non-streaming request asks whether its client is still there.
DISCONNECT_POLL_S = 0.25

Disconnected = Callable[[], Awaitable[bool]]  # Request.is_disconnected
Prompt = str | list[int]  # text, or token ids sent as such
Render = Callable[[GenerationEvent], list[bytes]]


@dataclass
class Started:
    """A request a worker has accepted: its id, its model (for the slot) and the rest of its events."""

    request_id: str
    model: ServedModel
    events: AsyncIterator[GenerationEvent]
    tenant: str  # whose rows of the model's queue it holds
    rows: int  # how many (n choices)


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event as bytes (app.sse frames it)."""
    return sse_message(data, event=event).encode()


def sse_error(error: ErrorBody) -> bytes:
    """The error envelope as an `event: error` SSE event."""
    return sse(error_body(error.code, error.message, error.field, error.details), event="error")


def sampling(**values: Any) -> SamplingParams:
    """SamplingParams from request fields; a combination the schema could not check is a 422."""
    try:
        return SamplingParams(**values)
    except ValidationError as exc:
        raise ValidationFailed(None, str(exc.errors()[0]["msg"]).removeprefix("Value error, ")) from exc


def extras(body: SamplingExtras, max_tokens: int, constrained: bool = False) -> dict[str, Any]:
    """SamplingParams' values of the fields beyond OpenAI's, the same on every route; a min_tokens above the tokens
    to generate, or min_tokens / ignore_eos with structured output (the grammar ends the output), is a 422."""
    if body.min_tokens > max_tokens:
        raise ValidationFailed("min_tokens", f"min_tokens ({body.min_tokens}) is more than the tokens to generate "
                               f"({max_tokens})")
    for name in ("min_tokens", "ignore_eos"):
        if constrained and getattr(body, name):
            raise ValidationFailed(name, f"{name} cannot be combined with structured output or tools: the grammar "
                                   "decides where the output ends")
    return {"top_k": max(body.top_k, 0), "repetition_penalty": body.repetition_penalty,
            "min_tokens": body.min_tokens, "ignore_eos": body.ignore_eos}


async def start(gateway: GenerationGateway, session: Session, principal: Principal, name: str, prompt: Prompt,
                params: SamplingParams, messages: list[ChatMessage] | None = None,
                chat: ChatOptions | None = None, *, tokens_field: str) -> Started:
    """Validate, admit, hand off; returns once the worker accepted the request (or raises its error). Errors about
    params.max_new_tokens name `tokens_field`, the field the client sent it in. A prompt is text or token ids."""
    gateway.check(params, tokens_field)
    model = await run_in_threadpool(gateway.resolve, session, principal, name)
    text, ids = (prompt, None) if isinstance(prompt, str) else ("", prompt)
    gateway.check_prompt(model, text, messages, chat, prompt_ids=ids)
    await run_in_threadpool(session.close)  # no connection held while generating
    request_id = await gateway.admit(principal, model, params.n)
    finished = False
    try:
        await gateway.submit(request_id, model, text, params, messages, tokens_field=tokens_field,
                             tenant=principal.tenant_id, chat=chat, prompt_ids=ids)
        events = gateway.events(request_id)
        first = await anext(events)
        if isinstance(first, ErrorEvent):
            finished = True
            raise from_wire(first.error)
    except BaseException:
        await gateway.release(request_id, model, finished=finished, tenant=principal.tenant_id, rows=params.n)
        raise
    if not isinstance(first, AcceptedEvent):  # the scheduler may stream a token before `accepted` is written
        events = _prepend(first, events)
    return Started(request_id, model, events, principal.tenant_id, params.n)


async def _prepend(first: GenerationEvent, rest: AsyncIterator[GenerationEvent]) -> AsyncIterator[GenerationEvent]:
    yield first
    async for event in rest:
        yield event


async def _final(events: AsyncIterator[GenerationEvent]) -> DoneEvent | ErrorEvent:
    async for event in events:
        if isinstance(event, DoneEvent | ErrorEvent):
            return event
    raise RuntimeError("event stream ended without a result")


async def collect(gateway: GenerationGateway, started: Started, disconnected: Disconnected) -> DoneEvent:
    """Wait for the result; a client that disconnects meanwhile cancels the request (ClientGone)."""
    finished = False
    waiting = asyncio.ensure_future(_final(started.events))
    try:
        while not waiting.done():
            await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
            if not waiting.done() and await disconnected():
                raise ClientGone("the client disconnected")
        final = waiting.result()
        finished = True
        if isinstance(final, ErrorEvent):
            raise from_wire(final.error)
        return final
    finally:
        waiting.cancel()
        await gateway.release(started.request_id, started.model, finished=finished, tenant=started.tenant,
                              rows=started.rows)


async def relay(gateway: GenerationGateway, started: Started, render: Render, *, done_marker: bool = True
                ) -> AsyncIterator[bytes]:
    """Relay events as SSE, then `data: [DONE]` (as the completions streams end; the Responses API's end with an
    event of their own instead); a client that goes away cancels this generator, and the release still happens."""
    finished = False
    try:
        async for event in started.events:
            if isinstance(event, ErrorEvent):
                finished = True
                yield sse_error(event.error)
                break
            for chunk in render(event):
                yield chunk
            if isinstance(event, DoneEvent):
                finished = True
                break
        if done_marker:
            yield sse("[DONE]")
    finally:
        await gateway.release(started.request_id, started.model, finished=finished, tenant=started.tenant,
                              rows=started.rows)


async def generate(gateway: GenerationGateway, session: Session, principal: Principal, body: GenerateRequest,
                   disconnected: Disconnected) -> GenerateResponse | AsyncIterator[bytes]:
    """/generate: the response, or (stream) its SSE events, one per token then the result."""
    params = sampling(max_new_tokens=body.max_new_tokens, temperature=body.temperature, top_p=body.top_p,
                      stop=body.stop, seed=body.seed, n=body.n, speculative=body.speculative,
                      **extras(body, body.max_new_tokens))
    started = await start(gateway, session, principal, body.model, body.prompt, params, tokens_field=GENERATE.name)
    request_id = started.request_id
    if not body.stream:
        done = await collect(gateway, started, disconnected)
        return GenerateResponse(id=request_id, model=body.model, choices=[c.model_dump() for c in done.choices],
                                usage=done.usage.model_dump())

    def render(event: GenerationEvent) -> list[bytes]:
        if isinstance(event, TokenEvent):
            return [sse({"id": request_id, "index": event.index, "text": event.text})]
        if isinstance(event, DoneEvent):
            return [sse({"id": request_id, "model": body.model, "choices": [c.model_dump() for c in event.choices],
                         "usage": event.usage.model_dump()})]
        return []

    return relay(gateway, started, render)


def openai_prompts(body: CompletionRequest, settings: Settings) -> list[Prompt]:
    """The request's prompts, each text or token ids; none, an empty one, too many (or more rows than a model's queue
    holds), or several streamed is a 422."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list[Prompt] = [prompt]
    elif prompt and isinstance(prompt[0], int):  # the schema admits no list that mixes kinds
        prompts = [cast(list[int], prompt)]
    else:
        prompts = cast(list[Prompt], list(prompt))
    if not prompts or not all(prompts):
        raise ValidationFailed("prompt", "send at least one prompt, and no empty one")
    if len(prompts) > settings.completions_max_prompts:
        raise ValidationFailed("prompt", f"{len(prompts)} prompts; one request lists at most "
                               f"{settings.completions_max_prompts} (TRAINSERVE_COMPLETIONS_MAX_PROMPTS)")
    if len(prompts) > 1 and body.stream:
        raise ValidationFailed("prompt", "several prompts are answered whole, not streamed: send stream false or "
                               "one prompt")
    rows = len(prompts) * (body.n or 1)
    if len(prompts) > 1 and rows > settings.generation_queue_per_model:  # held together: never admitted
        raise ValidationFailed("prompt", f"{len(prompts)} prompts x n {body.n or 1} = {rows} rows; a model's queue "
                               f"holds {settings.generation_queue_per_model} (TRAINSERVE_GENERATION_QUEUE_PER_MODEL): "
                               "send fewer prompts per request")
    return prompts


def openai_params(body: CompletionRequest, settings: Settings) -> tuple[list[Prompt], SamplingParams]:
    """Map OpenAI's fields; refuse the ones this server cannot honour instead of silently ignoring them."""
    unsupported = {"suffix": body.suffix, "logit_bias": body.logit_bias or None}
    for name, value in unsupported.items():
        if value:
            raise ValidationFailed(name, f"{name} is not supported by this server")
    if body.best_of not in (None, 1):
        raise ValidationFailed("best_of", "only best_of=1 is supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise ValidationFailed(name, f"{name} is not supported; use /generate with repetition_penalty")
    if body.echo and body.stream:
        raise ValidationFailed("echo", "echo is answered whole, not streamed: send stream false")
    prompts = openai_prompts(body, settings)
    stop = body.stop or []  # the schema checked it: a string or up to 4 strings, as a list
    max_tokens, _ = COMPLETIONS.chosen({COMPLETIONS.name: body.max_tokens})
    if max_tokens == 0 and not body.echo:
        raise ValidationFailed(COMPLETIONS.name, "max_tokens 0 scores the prompt alone: it needs echo true")
    constraint = constraint_of(body, settings)
    # max_tokens 0: one token is generated and left out of the answer (vLLM's way of scoring a prompt alone).
    return prompts, sampling(max_new_tokens=max(max_tokens, 1),
                             temperature=1.0 if body.temperature is None else body.temperature,
                             top_p=1.0 if body.top_p is None else body.top_p, stop=stop,
                             seed=body.seed, n=body.n or 1, logprobs=body.logprobs,
                             prompt_logprobs=body.logprobs if body.echo else None, constraint=constraint,
                             **extras(body, max_tokens, constraint is not None))


def legacy_logprobs(entries: list[TokenLogprob] | None, offset: int = 0,
                    prompt: PromptLogprobs | None = None) -> LegacyLogprobs:
    """OpenAI's legacy completions logprobs; text_offset counts characters from `offset`. An echoed prompt's
    entries come first, its first token's logprob and alternatives null (as OpenAI's legacy API and vLLM)."""
    rows: list[tuple[str, float | None, dict[str, float] | None]] = []
    if prompt is not None:
        rows.append((prompt.first.token, None, None))
    for entry in [*(prompt.scored if prompt is not None else []), *(entries or [])]:
        rows.append((entry.token, entry.logprob, {t.token: t.logprob for t in entry.top_logprobs}))
    offsets = []
    for token, _, _ in rows:
        offsets.append(offset)
        offset += len(token)
    return LegacyLogprobs(tokens=[r[0] for r in rows], token_logprobs=[r[1] for r in rows],
                          top_logprobs=[r[2] for r in rows], text_offset=offsets)


def completion_choices(body: CompletionRequest, prompt: Prompt, done: DoneEvent, first: int) -> list[CompletionChoice]:
    """One prompt's choices, numbered from `first`; with echo each begins with the prompt (max_tokens 0: is it)."""
    alone = bool(body.echo) and body.max_tokens == 0
    echoed = (prompt if isinstance(prompt, str) else done.prompt_text or "") if body.echo else ""
    choices = []
    for choice in done.choices:
        logprobs = None
        if body.logprobs is not None:
            logprobs = legacy_logprobs(None if alone else choice.logprobs,
                                       prompt=done.prompt_logprobs if body.echo else None)
        choices.append(CompletionChoice(text=echoed if alone else echoed + choice.text, index=first + choice.index,
                                        logprobs=logprobs,
                                        finish_reason="length" if alone else openai_reason(choice.finish_reason)))  # type: ignore[arg-type]
    return choices


def openai_reason(reason: str | None) -> str | None:
    return None if reason is None else "length" if reason == "length" else "stop"


async def complete(gateway: GenerationGateway, session: Session, principal: Principal, body: CompletionRequest,
                   disconnected: Disconnected) -> Completion | AsyncIterator[bytes]:
    """/v1/completions: an OpenAI Completion (one choice per prompt and n, in order), or (stream, one prompt) its
    chunks as SSE."""
    prompts, params = openai_params(body, gateway.settings)
    if not body.stream:
        return await _complete_whole(gateway, session, principal, body, prompts, params, disconnected)
    started = await start(gateway, session, principal, body.model, prompts[0], params, tokens_field=COMPLETIONS.name)
    completion_id, created = f"cmpl-{started.request_id.removeprefix('gen-')}", int(time.time())
    wants = params.logprobs is not None
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    offsets: dict[int, int] = {}  # characters streamed so far per choice, for text_offset

    def logprobs(event: TokenEvent) -> dict[str, Any] | None:
        if not wants:
            return None
        out = legacy_logprobs(event.logprobs, offsets.get(event.index, 0))
        offsets[event.index] = offsets.get(event.index, 0) + sum(len(t) for t in out.tokens)
        return out.model_dump()

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        return sse({"id": completion_id, "object": "text_completion", "created": created, "model": body.model,
                    "choices": choices, **({"usage": usage} if usage is not None else {})})

    def render(event: GenerationEvent) -> list[bytes]:
        if isinstance(event, TokenEvent):
            return [chunk([{"text": event.text, "index": event.index, "logprobs": logprobs(event),
                            "finish_reason": None}])]
        if not isinstance(event, DoneEvent):
            return []
        out = [chunk([{"text": "", "index": c.index, "logprobs": None,
                       "finish_reason": openai_reason(c.finish_reason)}]) for c in event.choices]
        if include_usage:
            out.append(chunk([], event.usage.openai()))
        return out

    return relay(gateway, started, render)


async def _complete_whole(gateway: GenerationGateway, session: Session, principal: Principal,
                          body: CompletionRequest, prompts: list[Prompt], params: SamplingParams,
                          disconnected: Disconnected) -> Completion:
    """Every prompt its own request, admitted in turn and decoded together; one Completion of all their choices. A
    prompt refused or failed fails the whole answer, and the others are cancelled."""
    started: list[Started] = []
    try:
        for prompt in prompts:
            started.append(await start(gateway, session, principal, body.model, prompt, params,
                                       tokens_field=COMPLETIONS.name))
    except BaseException:
        for one in started:
            await gateway.release(one.request_id, one.model, finished=False, tenant=one.tenant, rows=one.rows)
        raise
    waits = [asyncio.ensure_future(collect(gateway, one, disconnected)) for one in started]
    try:
        dones = await asyncio.gather(*waits)
    except BaseException:
        for wait in waits:
            wait.cancel()  # collect's release cancels its request on the worker
        await asyncio.gather(*waits, return_exceptions=True)
        raise
    alone = bool(body.echo) and body.max_tokens == 0
    choices = [choice for at, (prompt, done) in enumerate(zip(prompts, dones, strict=True))
               for choice in completion_choices(body, prompt, done, at * params.n)]
    prompt_tokens = sum(done.usage.prompt_tokens for done in dones)
    completion_tokens = 0 if alone else sum(done.usage.completion_tokens for done in dones)
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                  cached_tokens=sum(done.usage.cached_tokens for done in dones))
    return Completion(id=f"cmpl-{started[0].request_id.removeprefix('gen-')}", created=int(time.time()),
                      model=body.model, choices=choices, usage=CompletionUsage(**usage.openai()))
