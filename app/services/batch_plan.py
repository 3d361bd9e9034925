"""A batch's lines checked as the routes they name would check them, into the plan a worker runs.

Each endpoint is one entry of PLANNERS: a function from a line's body to a PlannedLine (what to run), raising the
domain error the interactive route would answer with; that error becomes the line's entry in the batch's error
file, never a failed batch. Each entry's worker side is worker.batches.lines.LINE_HANDLERS.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from pydantic import BaseModel, ValidationError

from app.errors import status_for
from app.schemas.chat import ChatCompletionRequest
from app.schemas.embeddings import EmbeddingRequest
from app.schemas.generation import CompletionRequest
from app.services.chat import chat_params
from app.services.completions import openai_params
from app.services.embeddings import split_inputs
from core.batches import LineError, PlannedLine
from core.errors import DomainError, ValidationFailed
from core.generation_limits import COMPLETIONS, server_refusal
from core.jobspec import field_of
from core.protocol import ErrorCode
from core.served_models import ServedModel
from core.settings import Settings


@dataclass(frozen=True)
class Planning:
    """What planning a line may look up: model names resolved as the routes resolve them (NotFound or
    ValidationFailed naming `model`), and the server's limits."""

    served: Callable[[str], ServedModel]  # a generation model name to what serves it
    embedding: Callable[[str], str]  # an embedding model name to the reference a worker loads
    settings: Settings


Planner = Callable[[dict[str, Any], Planning], PlannedLine]


def _parsed(schema: type[BaseModel], body: dict[str, Any]) -> Any:
    """The body as the route's schema reads it (a ValidationFailed naming the first field at fault)."""
    try:
        parsed = schema.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = field_of(tuple(first.get("loc", ())), first.get("ctx"))
        raise ValidationFailed(field, f"{field}: {first['msg']}" if field else str(first["msg"])) from exc
    if getattr(parsed, "stream", False):
        raise ValidationFailed("stream", "a batch runs without streaming; leave stream unset")
    return parsed


def _plan_chat(body: dict[str, Any], planning: Planning) -> PlannedLine:
    request = _parsed(ChatCompletionRequest, body)
    messages, params, options, tokens_field = chat_params(request, planning.settings)
    served = planning.served(request.model)
    return PlannedLine(custom_id="", url="/v1/chat/completions", model=request.model, path=served.path,
                       adapter=served.adapter, messages=messages, params=params, tokens_field=tokens_field,
                       chat=options)


def _plan_completion(body: dict[str, Any], planning: Planning) -> PlannedLine:
    request = _parsed(CompletionRequest, body)
    if request.logprobs is not None:  # the legacy logprobs shape is built by the interactive route only
        raise ValidationFailed("logprobs", "logprobs are not returned by batch completions; use the chat endpoint")
    if request.echo:  # as logprobs: the echoed answer is built by the interactive route only
        raise ValidationFailed("echo", "echo is not answered by batch completions; use /v1/completions")
    prompts, params = openai_params(request, planning.settings)
    prompt = prompts[0]
    if len(prompts) != 1 or not isinstance(prompt, str):
        raise ValidationFailed("prompt", "a batch line holds one prompt, as text")
    served = planning.served(request.model)
    return PlannedLine(custom_id="", url="/v1/completions", model=request.model, path=served.path,
                       adapter=served.adapter, prompt=prompt, params=params, tokens_field=COMPLETIONS.name)


def _plan_embeddings(body: dict[str, Any], planning: Planning) -> PlannedLine:
    request = _parsed(EmbeddingRequest, body)
    texts, token_ids = split_inputs(request, planning.settings)
    return PlannedLine(custom_id="", url="/v1/embeddings", model=request.model, path=planning.embedding(request.model),
                       texts=texts, token_ids=token_ids, dimensions=request.dimensions,
                       encoding_format=request.encoding_format)


PLANNERS: dict[str, Planner] = {
    "/v1/chat/completions": _plan_chat,
    "/v1/completions": _plan_completion,
    "/v1/embeddings": _plan_embeddings,
}


def line_error(exc: DomainError) -> LineError:
    """A domain error as a line's error (its HTTP status as the interactive route would answer)."""
    return LineError(status_code=status_for(exc), code=str(exc.code or ErrorCode.ERROR), message=exc.message,
                     param=exc.field)


def plan_lines(stream: IO[bytes], *, endpoint: str, planning: Planning) -> Iterator[PlannedLine]:
    """The checked lines of a batch input file (already valid as a file: core.batch_data checked its envelope)."""
    for number, raw in enumerate(stream, start=1):
        if not raw.strip():
            continue
        record = json.loads(raw)
        if record["url"] != endpoint:
            raise ValidationFailed("input_file_id", f"line {number}: url {record['url']} is not the batch's "
                                                    f"endpoint {endpoint}; one batch runs one endpoint")
        try:
            planned = PLANNERS[record["url"]](record["body"], planning)
            _check_limits(planned, planning.settings)
        except DomainError as exc:
            planned = PlannedLine(custom_id="", url=record["url"], model=str(record["body"].get("model") or ""),
                                  error=line_error(exc))
        planned.custom_id = record["custom_id"]
        yield planned


def _check_limits(planned: PlannedLine, settings: Settings) -> None:
    """The server's limits, as the interactive route checks them (naming the line's token field)."""
    if planned.params is not None and (refusal := server_refusal(planned.params, planned.tokens_field, settings)):
        raise ValidationFailed(*refusal)
