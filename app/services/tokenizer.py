"""/tokenize and /detokenize in vLLM's shapes: a served model's own tokenizer, which only a generation worker holds
(the API imports no tokenizer), asked like a generation request: admitted, handed off, answered by one event."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from app.errors import from_wire
from app.schemas.generation import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from app.services.generation import GenerationGateway, check_token_count
from core.auth import Principal
from core.protocol import ErrorEvent, SamplingParams, TokensEvent
from core.served_models import ServedModel


async def tokenize(gateway: GenerationGateway, session: Session, principal: Principal,
                   body: TokenizeRequest) -> TokenizeResponse:
    """The prompt's token ids, as the model's prompts get them (with its special tokens unless told otherwise)."""
    model = await run_in_threadpool(gateway.resolve, session, principal, body.model)
    gateway.check_prompt(model, body.prompt, None)
    await run_in_threadpool(session.close)  # no connection held while the worker answers
    answer = await _ask(gateway, principal, model, op="tokenize", prompt=body.prompt,
                        add_special_tokens=body.add_special_tokens)
    return TokenizeResponse(tokens=answer.ids, count=len(answer.ids), max_model_len=answer.context)


async def detokenize(gateway: GenerationGateway, session: Session, principal: Principal,
                     body: DetokenizeRequest) -> DetokenizeResponse:
    """The text of token ids (special tokens included); ids outside the model's vocabulary are a 422 naming tokens."""
    model = await run_in_threadpool(gateway.resolve, session, principal, body.model)
    check_token_count(model, len(body.tokens), "tokens")
    await run_in_threadpool(session.close)
    answer = await _ask(gateway, principal, model, op="detokenize", prompt="", prompt_ids=body.tokens)
    return DetokenizeResponse(prompt=answer.text)


async def _ask(gateway: GenerationGateway, principal: Principal, model: ServedModel, *, prompt: str,
               **task: Any) -> TokensEvent:
    """Admit (the key's rate and one row of the model's queue), hand off, wait for the tokenizer's answer."""
    request_id = await gateway.admit(principal, model)
    finished = False
    try:
        await gateway.submit(request_id, model, prompt, SamplingParams(), tokens_field="tokens",
                             tenant=principal.tenant_id, **task)
        async for event in gateway.events(request_id):
            if isinstance(event, ErrorEvent):
                finished = True
                raise from_wire(event.error)
            if isinstance(event, TokensEvent):
                finished = True
                return event
        raise RuntimeError("the worker's events ended without an answer")
    finally:
        await gateway.release(request_id, model, finished=finished, tenant=principal.tenant_id)
