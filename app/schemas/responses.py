"""Schemas of /v1/responses (OpenAI's Responses API shapes).

The request's items, tools and text format stay plain JSON here: app/services/response_items.py checks each and
names the field it refuses (`input.2.content.0.type`), where a union of models would answer with every member's
complaint at once.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.schemas.generation import SamplingExtras
from core.generation_limits import CHAT, MAX_TOKENS_BOUND


class ResponseCreate(SamplingExtras):
    """OpenAI's POST /v1/responses body. Unknown fields and options trainserve cannot honour are refused."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200)
    input: str | list[dict[str, Any]] = Field(description="Text (one user message), or a list of items: messages "
                                              "(input_text parts), function_call and function_call_output.")
    instructions: str | None = Field(None, description="A system message before the input; not carried on by "
                                     "previous_response_id.")
    previous_response_id: str | None = Field(None, description="A stored response of this tenant: its input and "
                                             "output come before this input.")
    store: bool | None = Field(True, description="Keep the response for GET /v1/responses/{id} and "
                               "previous_response_id, for TRAINSERVE_RESPONSES_RETENTION_S.")
    stream: bool | None = False
    stream_options: dict[str, Any] | None = Field(None, description='{"include_obfuscation": bool}; no '
                                                  "obfuscation is ever added.")
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_BOUND, description="Tokens to generate at most "
                                          f"(default {CHAT.default}), reasoning included; at most the server's "
                                          "TRAINSERVE_MAX_NEW_TOKENS.")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = Field(None, description='Function tools: {"type": "function", "name", '
                                               '"description", "parameters", "strict"}.')
    tool_choice: str | dict[str, Any] | None = Field(None, description='"none", "auto", "required" or '
                                                     '{"type": "function", "name": ...}.')
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(None, description='{"format": {"type": "text" | "json_object"}} or '
                                        '{"format": {"type": "json_schema", "name", "schema", "strict"}}.')
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16, description="Up to 16 pairs (keys up to 64 characters, values up to 512), kept with "
        "the response.")
    include: list[str] | None = Field(None, description="Extra output to include; none is offered, so only [].")
    background: bool | None = Field(None, description="Only false: every response is answered in the request.")
    truncation: Literal["disabled"] | None = Field(None, description='Only "disabled": an input over the model\'s '
                                                   "context is a 422.")
    reasoning: dict[str, Any] | None = Field(None, description="Only null or {}: a thinking model's template decides; "
                                             'chat_template_kwargs {"enable_thinking": false} turns it off.')
    service_tier: Literal["auto", "default"] | None = None
    user: str | None = Field(None, max_length=256)
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra arguments of the model's chat "
                                                        "template, e.g. {\"enable_thinking\": false}.")



class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    """OpenAI's Response object; output items are OpenAI's message, function_call and reasoning items."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    metadata: dict[str, str]
    store: bool
    background: bool = False
    truncation: Literal["disabled"] = "disabled"
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    service_tier: str = "default"
    user: str | None = None
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: Literal[True] = True


class InputItemList(BaseModel):
    """A page of a response's input items, as OpenAI's list (`after`: the last id of the page before)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
