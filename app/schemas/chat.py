"""Schemas of /v1/chat/completions (OpenAI's shapes) and the structured-output fields both /v1 routes share."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.schemas.generation import CompletionUsage, OpenAISampling
from core.protocol import MAX_TOP_LOGPROBS, TokenLogprob


class ChatMessageIn(BaseModel):
    """One message; content as a string or OpenAI's list of text parts."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = None


class ChatCompletionRequest(OpenAISampling):
    """OpenAI's /v1/chat/completions body. Unknown fields and options trainserve cannot honour are refused."""

    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessageIn] = Field(min_length=1, max_length=1000)
    max_tokens: int | None = Field(None, ge=1, le=8192, description="Deprecated by OpenAI; max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, le=8192, description="Default 256.")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
