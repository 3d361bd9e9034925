"""/v1/responses (OpenAI's Responses API), apart from HTTP: create (whole or streamed), retrieve, delete, cancel and
a response's input items.

A request runs as a chat (app/services/response_items.py translates it, app/services/chat.py checks it, the worker
answers it as any chat). With `store` (OpenAI's default) the answer is kept per tenant for
TRAINSERVE_RESPONSES_RETENTION_S: with the context it ran in, so `previous_response_id` puts the earlier request's
conversation, its input and its output before a new input (instructions are not carried on, as OpenAI's). A
streamed answer is kept once it is complete, before its last event, in a session of its own (no connection is held
while the client reads the stream).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from app.schemas.responses import InputItemList, Response, ResponseCreate, ResponseDeleted
from app.services.chat import chat_params
from app.services.completions import Disconnected, collect, relay, sse, start
from app.services.generation import GenerationGateway
from app.services.response_items import (
    chat_request,
    input_items,
    output_items,
    refuse_include,
    response_status,
    response_usage,
    responses_field,
)
from app.services.response_stream import Event, ResponseStream
from core.auth import Principal
from core.db import session_scope
from core.errors import Conflict, DomainError, ValidationFailed
from core.protocol import DoneEvent, GenerationEvent, TokenEvent
from core.rows import new_id
from core.store.responses import delete_response, find_response, keep_response


@contextmanager
def _named_as_responses() -> Iterator[None]:
    """An error of the chat path (or the worker) names the Responses field the client sent."""
    try:
        yield
    except DomainError as exc:
        exc.field = responses_field(exc.field)
        raise


def _response(response_id: str, created: int, body: ResponseCreate, status: str,
              output: list[dict[str, Any]] | None = None, done: DoneEvent | None = None) -> Response:
    """The Response object: the request's settings as answered, then its output and usage once done."""
    tools = body.tools or []
    return Response.model_validate({
        "id": response_id, "created_at": created, "status": status, "model": body.model, "output": output or [],
        "instructions": body.instructions, "previous_response_id": body.previous_response_id,
        "max_output_tokens": body.max_output_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p, "tools": tools,
        "tool_choice": body.tool_choice or ("auto" if tools else "none"),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": body.text or {"format": {"type": "text"}}, "metadata": body.metadata or {},
        "store": body.store is not False, "user": body.user,
        "usage": response_usage(done.usage) if done is not None else None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None})


def _keep(sessions: sessionmaker[Session], principal: Principal, body: ResponseCreate, response: Response,
          context: list[dict[str, Any]], items: list[dict[str, Any]], retention_s: float) -> None:
    with session_scope(sessions) as session:
        keep_response(session, response_id=response.id, tenant=principal.tenant_id, model=body.model,
                      previous_response_id=body.previous_response_id, context=context, input_items=items,
                      body=response.model_dump(mode="json"), retention_s=retention_s)


async def create_response(gateway: GenerationGateway, session: Session, sessions: sessionmaker[Session],
                          principal: Principal, body: ResponseCreate, disconnected: Disconnected
                          ) -> Response | AsyncIterator[bytes]:
    """POST /v1/responses: the Response, or (stream) its typed events as SSE."""
    settings = gateway.settings
    items = input_items(body.input)
    context: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        earlier = await run_in_threadpool(lambda: find_response(
            session, response_id=str(body.previous_response_id), tenant=principal.tenant_id,
            field="previous_response_id"))
        context = [*earlier.context, *earlier.input_items, *earlier.body["output"]]
    with _named_as_responses():
        messages, params, options, _ = chat_params(chat_request(body, [*context, *items]), settings)
        started = await start(gateway, session, principal, body.model, "", params, messages, options,
                              tokens_field="max_output_tokens")
    response_id, created = new_id("resp"), int(time.time())
    store = body.store is not False

    async def kept(response: Response) -> Response:
        if store:
            await run_in_threadpool(_keep, sessions, principal, body, response, context, items,
                                    settings.responses_retention_s)
        return response

    if not body.stream:
        with _named_as_responses():
            done = await collect(gateway, started, disconnected)
        choice = done.choices[0]
        return await kept(_response(response_id, created, body, response_status(choice.finish_reason),
                                    output_items(choice), done))
    stream = ResponseStream()
    finals: list[DoneEvent] = []

    def frame(event: Event) -> bytes:
        return sse(event, event=event["type"])

    def render(event: GenerationEvent) -> list[bytes]:
        if isinstance(event, TokenEvent):
            return [frame(e) for e in stream.feed(event.text, event.reasoning, event.tool_calls)]
        if isinstance(event, DoneEvent):
            finals.append(event)
            return [frame(e) for e in stream.finish(response_status(event.choices[0].finish_reason))]
        return []

    async def events() -> AsyncIterator[bytes]:
        opened = _response(response_id, created, body, "in_progress").model_dump(mode="json")
        yield frame(stream.event("response.created", response=opened))
        yield frame(stream.event("response.in_progress", response=opened))
        async for chunk in relay(gateway, started, render, done_marker=False):
            yield chunk
        if not finals:  # an error event ended the stream
            return
        status = response_status(finals[0].choices[0].finish_reason)
        response = await kept(_response(response_id, created, body, status, stream.items, finals[0]))
        yield frame(stream.event(f"response.{status}", response=response.model_dump(mode="json")))

    return events()


def get_response(session: Session, principal: Principal, response_id: str) -> Response:
    """GET /v1/responses/{id}: a stored response of the caller's tenant."""
    return Response.model_validate(find_response(session, response_id=response_id, tenant=principal.scope).body)


def remove_response(session: Session, principal: Principal, response_id: str) -> ResponseDeleted:
    """DELETE /v1/responses/{id}."""
    delete_response(session, response_id=response_id, tenant=principal.scope)
    session.commit()
    return ResponseDeleted(id=response_id)


def cancel_response(session: Session, principal: Principal, response_id: str) -> Response:
    """POST /v1/responses/{id}/cancel: only a background response can be cancelled, and this server answers every
    response in its request, so a stored one is a 409 (a missing one a 404)."""
    find_response(session, response_id=response_id, tenant=principal.scope)
    raise Conflict(f"response {response_id!r} was not created with background true; only background responses can "
                   "be cancelled", field="response_id")


def list_input_items(session: Session, principal: Principal, response_id: str, *, after: str | None, limit: int,
                     order: Literal["asc", "desc"], include: list[str]) -> InputItemList:
    """GET /v1/responses/{id}/input_items: the request's own input items (not the chain's), a page at a time."""
    refuse_include(include)
    items = find_response(session, response_id=response_id, tenant=principal.scope).input_items
    ordered = items if order == "asc" else items[::-1]
    start_at = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise ValidationFailed("after", f"{after!r} is not an input item of response {response_id!r}")
        start_at = ids.index(after) + 1
    page = ordered[start_at:start_at + limit]
    return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                         last_id=page[-1]["id"] if page else None, has_more=start_at + limit < len(ordered))
