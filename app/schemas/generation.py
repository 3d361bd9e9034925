"""Schemas of /generate and the OpenAI-compatible routes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from app.schemas.structured import StructuredFields
from core.generation_limits import COMPLETIONS, GENERATE, MAX_TOKENS_BOUND


def _stops(value: Any) -> list[str]:
    """A string or a list of up to 4 strings of 1-100 characters; any other JSON type is a 422, never a 500."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise ValueError("stop must be a string or a list of up to 4 strings")
    if len(items) > 4:
        raise ValueError("at most 4 stop sequences")
    if any(not 1 <= len(item) <= 100 for item in items):
        raise ValueError("stop sequences must be 1-100 characters")
    return list(items)


_STOP = {"type": "string", "minLength": 1, "maxLength": 100}
# Always a list once validated; the documented shape is OpenAI's (a string, or a list of up to 4).
StopSequences = Annotated[list[str], BeforeValidator(_stops), WithJsonSchema(
    {"anyOf": [_STOP, {"type": "array", "items": _STOP, "maxItems": 4}]})]


class SamplingExtras(BaseModel):
    """The sampling fields beyond OpenAI's that /generate, /v1/completions and /v1/chat/completions all take (vLLM's
    names and meanings), honoured alike by both engines; any other unknown field is a 422 naming it."""

    top_k: int = Field(0, ge=-1, le=10_000, description="0 (or vLLM's -1) disables top-k.")
    repetition_penalty: float = Field(1.0, gt=0, le=10, description="1 disables it; >1 discourages tokens already "
                                      "in the prompt or the output (HF's CTRL rule).")
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_BOUND, description="Tokens each choice generates before the "
                            "end-of-sequence token or a stop string may end it; at most the tokens to generate.")
    ignore_eos: bool = Field(False, description="The end-of-sequence token never ends a choice: it runs to the "
                             "tokens to generate or a stop string (benchmark clients send it).")


class GenerateRequest(SamplingExtras):
    """A completion request; parameters apply per request even inside a shared batch."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200)
    prompt: str = Field(min_length=1, max_length=100_000)
    max_new_tokens: int = Field(GENERATE.default, ge=1, le=MAX_TOKENS_BOUND, description="Tokens to generate at "
                                "most per choice; at most the server's TRAINSERVE_MAX_NEW_TOKENS.")
    temperature: float = Field(1.0, ge=0, le=5, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    stop: StopSequences = Field(default_factory=list, description="A string or up to 4 stop sequences.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Same seed, same text, whatever shares the batch.")
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    speculative: bool = Field(True, description="False: never decode this request with prompt-lookup drafts, where "
                              "the server speculates (greedy output is the same either way).")


class GeneratedChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["length", "stop", "eos"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class GenerateResponse(BaseModel):
    id: str
    model: str
    choices: list[GeneratedChoice]
    usage: Usage


class OpenAISampling(StructuredFields, SamplingExtras):
    """The fields /v1/completions and /v1/chat/completions share, with one set of bounds and defaults."""

    model: str = Field(min_length=1, max_length=200)
    temperature: float | None = Field(1.0, ge=0, le=2)
    top_p: float | None = Field(1.0, gt=0, le=1)
    n: int | None = Field(1, ge=1, le=16)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    stop: StopSequences | None = Field(None, description="A string or up to 4 stop sequences.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float | None = 0
    frequency_penalty: float | None = 0
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(OpenAISampling):
    """OpenAI's /v1/completions body. Unknown fields and parameters trainserve cannot honour are refused."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]] = Field(
        description="A prompt as text or as token ids, or a list of prompts (one choice per prompt and n, in order; "
        "at most TRAINSERVE_COMPLETIONS_MAX_PROMPTS, not streamed).")
    max_tokens: int | None = Field(COMPLETIONS.default, ge=0, le=MAX_TOKENS_BOUND, description="Tokens to "
                                   "generate at most per choice; at most the server's TRAINSERVE_MAX_NEW_TOKENS. 0 "
                                   "with echo: the prompt alone, scored.")
    echo: bool | None = Field(False, description="The choice's text and logprobs begin with the prompt's (its first "
                              "token's logprob null); not streamed.")
    logprobs: int | None = Field(None, ge=0, le=5, description="The sampled token's logprob and the top N (0-5).")
    best_of: int | None = None
    suffix: str | None = None


class LegacyLogprobs(BaseModel):
    """OpenAI's /v1/completions logprobs: parallel lists, top_logprobs as {token: logprob} per position (an echoed
    prompt's first token: null in both)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: LegacyLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not prefilled again)


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    target: str | None = Field(None, description="An alias's target (the model it serves); null for a model.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a served model's tokenizer on a text."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200)
    prompt: str = Field(min_length=1)
    add_special_tokens: bool = Field(True, description="With the tokenizer's own special tokens (Llama's BOS), as a "
                                     "prompt gets them.")


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize body: token ids back to text with a served model's tokenizer."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200)
    tokens: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)


class DetokenizeResponse(BaseModel):
    prompt: str
