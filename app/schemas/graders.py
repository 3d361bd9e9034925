"""OpenAI's /v1/fine_tuning/alpha/graders: run a grader on one sample, or validate it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from core.graders import Grader


class GraderRunRequest(BaseModel):
    """A grader, the model's sample (`sample.output_text`; `sample.output_json` when it is JSON) and the item."""

    model_config = ConfigDict(extra="forbid")

    grader: Grader
    model_sample: str = Field(max_length=200_000)
    item: dict[str, Any] | None = None


class GraderValidateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grader: Grader


class GraderValidateResponse(BaseModel):
    grader: dict[str, Any]


class GraderRunMetadata(BaseModel):
    name: str
    type: str
    errors: dict[str, Any]
    execution_time: float
    scores: dict[str, Any]
    token_usage: int | None = None
    sampled_model_name: str | None = None


class GraderRunResponse(BaseModel):
    """OpenAI's run result: the reward, sub-rewards of a multi grader, error flags, judges' token usage."""

    reward: float
    metadata: GraderRunMetadata
    sub_rewards: dict[str, Any]
    model_grader_token_usage_per_model: dict[str, Any]
