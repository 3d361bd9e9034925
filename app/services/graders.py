"""The graders API (run, validate) and the served models graders call: the API's chat and embeddings services."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from app.schemas.chat import ChatCompletion, ChatCompletionRequest
from app.schemas.embeddings import EmbeddingRequest
from app.schemas.graders import (
    GraderRunMetadata,
    GraderRunRequest,
    GraderRunResponse,
    GraderValidateRequest,
    GraderValidateResponse,
)
from app.services import chat as chat_service
from app.services import embeddings as embedding_service
from app.services.completions import Disconnected
from app.services.generation import GenerationGateway
from core.auth import Principal
from core.errors import DomainError, ValidationFailed
from core.graders import Grade, Grader, JudgeReply, ModelCallFailed, grade, sample_namespace
from core.graders.models import DEFAULT_EMBEDDING_MODEL, calls_refusal, judge_refusal, judge_tokens
from core.graders.spec import JudgeSampling
from core.settings import Settings


class ServedModels:
    """core.graders.Models over this API's own chat and embeddings services, as the caller (their quotas, their
    models)."""

    def __init__(self, gateway: GenerationGateway, session: Session, principal: Principal,
                 disconnected: Disconnected) -> None:
        self.gateway, self.session, self.principal, self.disconnected = gateway, session, principal, disconnected

    async def chat(self, model: str, messages: list[dict[str, str]], *, schema: dict[str, Any],
                   sampling: JudgeSampling | None) -> JudgeReply:
        tokens = judge_tokens(sampling, self.gateway.settings.max_new_tokens)
        sampling = sampling or JudgeSampling()
        try:  # the grader's own fields were checked already; what the chat route adds is checked here
            body = ChatCompletionRequest(
                model=model, messages=messages,  # type: ignore[arg-type]
                max_completion_tokens=tokens,
                temperature=0.0 if sampling.temperature is None else sampling.temperature, top_p=sampling.top_p,
                seed=sampling.seed, response_format={"type": "json_schema", "json_schema": {
                    "name": "grade", "schema": schema, "strict": True}})
        except ValidationError as exc:
            raise ValidationFailed("grader", f"the judge's request is not valid: {exc.errors()[0]['msg']}") from exc
        try:
            answer = await chat_service.chat(self.gateway, self.session, self.principal, body, self.disconnected)
        except DomainError as exc:
            raise ModelCallFailed(f"{exc.code}: {exc.message}") from exc
        assert isinstance(answer, ChatCompletion)  # not streamed
        choice = answer.choices[0]
        usage = answer.usage
        return JudgeReply(text=choice.message.content, prompt_tokens=usage.prompt_tokens if usage else 0,
                          completion_tokens=usage.completion_tokens if usage else 0,
                          truncated=choice.finish_reason == "length")

    async def embed(self, model: str | None, texts: list[str]) -> list[list[float]]:
        settings: Settings = self.gateway.settings
        body = EmbeddingRequest(model=model or DEFAULT_EMBEDDING_MODEL, input=texts)
        try:
            answer = await embedding_service.embed(self.session, settings, self.gateway.queue, self.gateway.redis,
                                                   self.principal, body, self.disconnected)
        except DomainError as exc:
            raise ModelCallFailed(f"{exc.code}: {exc.message}") from exc
        return answer.floats()


def run_response(result: Grade) -> GraderRunResponse:
    """A Grade in OpenAI's run-result shape."""
    scores: dict[str, Any] = dict(result.sub_scores) or {result.name: result.score}
    tokens = sum(usage.get("total_tokens", 0) for usage in result.token_usage.values())
    return GraderRunResponse(
        reward=result.score, sub_rewards=dict(result.sub_scores),
        model_grader_token_usage_per_model=dict(result.token_usage),
        metadata=GraderRunMetadata(name=result.name, type=result.type, errors=result.flags(),
                                   execution_time=result.execution_time, scores=scores,
                                   token_usage=tokens if result.token_usage else None))


def check_judges(grader: Grader, settings: Settings) -> None:
    """A model grader whose judge would answer in more tokens than this server generates, or a grader that would
    call served models more than Settings.max_grader_model_calls times, is a 422 naming its field (under `grader`),
    before anything runs."""
    if (refusal := judge_refusal(grader, settings.max_new_tokens, "grader")) is not None:
        raise ValidationFailed(*refusal)
    if (refusal := calls_refusal([("grader", grader)], settings.max_grader_model_calls)) is not None:
        raise ValidationFailed(*refusal)


async def run_grader(models: ServedModels, body: GraderRunRequest) -> GraderRunResponse:
    """Grade one model sample against one item."""
    check_judges(body.grader, models.gateway.settings)
    result = await grade(body.grader, item=body.item or {}, sample=sample_namespace(body.model_sample),  # type: ignore[arg-type]
                         models=models)
    return run_response(result)


def validate_grader(body: GraderValidateRequest, settings: Settings) -> GraderValidateResponse:
    """The grader as it will run on this server (its judges within the server's token cap)."""
    check_judges(body.grader, settings)
    return GraderValidateResponse(grader=body.grader.model_dump(by_alias=True, exclude_none=True))
