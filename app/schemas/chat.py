"""Schemas of /v1/chat/completions (OpenAI's shapes) and the structured-output fields both /v1 routes share."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.schemas.generation import CompletionUsage, OpenAISampling
from core.generation_limits import CHAT, MAX_TOKENS_BOUND
from core.protocol import MAX_TOP_LOGPROBS, TokenLogprob


class ChatMessageIn(BaseModel):
    """One message; content as a string or OpenAI's list of text parts."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="An assistant's earlier calls.")
    tool_call_id: str | None = Field(None, description="A tool result: the id of the call it answers.")


class ChatCompletionRequest(OpenAISampling):
    """OpenAI's /v1/chat/completions body. Unknown fields and options trainserve cannot honour are refused."""

    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessageIn] = Field(min_length=1, max_length=1000)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_BOUND,
                                   description="Deprecated by OpenAI; max_completion_tokens.")
    max_completion_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS_BOUND, description=f"Tokens to generate at most per choice (default {CHAT.default}); "
        "at most the server's TRAINSERVE_MAX_NEW_TOKENS.")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = Field(None, description="Function tools; calls always match their "
                                                    "parameters' JSON schema.")
    tool_choice: str | dict[str, Any] | None = Field(None, description='"none", "auto" (the default with tools), '
                                                     '"required" or {"type": "function", "function": {"name"}}.')
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra arguments of the model's chat "
                                                        "template, e.g. {\"enable_thinking\": false}.")


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, valid against the tool's parameters


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # the template's thinking section (Qwen 3's <think>)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
