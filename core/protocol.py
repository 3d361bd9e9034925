"""The typed wire protocol between the API and the workers: every message on the broker or a Redis stream.

The API builds these models, the broker and Redis carry their JSON, the worker validates them back;
`ErrorCode` names every error code the service emits (HTTP envelopes, SSE error events, job rows).
"""

from __future__ import annotations

import math
import time
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from core.generation_limits import GENERATE
from core.public_text import public_text

if TYPE_CHECKING:
    from core.settings import Settings

MAX_SEED = 2**63 - 1


class ErrorCode(StrEnum):
    """Every machine-readable error code the service answers with or records on a job."""

    ERROR = "error"
    VALIDATION_ERROR = "validation_error"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    HTTP_ERROR = "http_error"
    CONFLICT = "conflict"
    ILLEGAL_TRANSITION = "illegal_transition"
    STALE_ATTEMPT = "stale_attempt"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    UNAUTHORIZED = "unauthorized"
    KEY_IN_QUERY = "key_in_query"
    RATE_LIMITED = "rate_limited"
    QUOTA_EXCEEDED = "quota_exceeded"
    TOO_MANY_UPLOADS = "too_many_uploads"
    TOO_MANY_REFUSALS = "too_many_refusals"
    REQUEST_TIMEOUT = "request_timeout"
    TOO_MANY_STREAMS = "too_many_streams"
    TOO_MANY_DOWNLOADS = "too_many_downloads"
    OVERLOADED = "overloaded"
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
    BROKER_UNAVAILABLE = "broker_unavailable"
    DATABASE_UNAVAILABLE = "database_unavailable"
    QUEUE_TIMEOUT = "queue_timeout"
    WORKER_TIMEOUT = "worker_timeout"
    WORKER_ERROR = "worker_error"
    INTERNAL_ERROR = "internal_error"
    CLIENT_DISCONNECTED = "client_disconnected"
    # Job failures recorded on the row by the worker.
    TRAINING_ERROR = "training_error"
    OOM = "oom"
    WORKER_LOST = "worker_lost"
    NODE_LOST = "node_lost"  # a job on several nodes lost one (or its gang did not assemble) too many times
    DATASET_MISSING = "dataset_missing"
    DOES_NOT_FIT = "does_not_fit"
    STORAGE_UNAVAILABLE = "storage_unavailable"  # also a job failure: the artifact store could not be reached


class ErrorBody(BaseModel):
    """The one error envelope's body: REST responses, SSE `event: error`, stream events and job rows."""

    code: str
    message: str
    field: str | None = None
    details: Any = None

    def envelope(self) -> dict[str, Any]:
        """`{"error": {...}}`, with `details` only when there are some."""
        body: dict[str, Any] = {"code": str(self.code), "message": public_text(self.message), "field": self.field}
        if self.details is not None:
            body["details"] = self.details
        return {"error": body}


def error_body(code: str, message: str, field: str | None = None, details: Any = None) -> dict[str, Any]:
    """The JSON error envelope `{"error": {"code", "message", "field"[, "details"]}}`."""
    return ErrorBody(code=code, message=message, field=field, details=details).envelope()


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


MAX_TOP_LOGPROBS = 20


class Constraint(BaseModel):
    """What a constrained row may emit: a JSON schema, any JSON object, one of some strings, or a regex.

    `spec` is the schema as JSON text, the regex, or the choices as a JSON list; the engine compiles each
    (kind, spec) once and caches it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["json_schema", "json_object", "choice", "regex", "lark"]
    spec: str = ""  # "lark": a whole llguidance grammar, built by the worker (tool calls, reasoning first)
    field: str | None = None  # the request field a "lark" grammar (tools or response_format) or guided_json came from


class SamplingParams(BaseModel):
    """How one request is decoded; the API, the task payload and the engine share this one definition.

    Invalid values raise ValueError (pydantic's ValidationError is one) when the object is built.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int = GENERATE.default
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # (0, 1]
    repetition_penalty: float = 1.0  # CTRL/HF: positive logits divided, negative multiplied
    stop: tuple[str, ...] = ()
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the k most likely (0-20)
    # None: none; k: every prompt token's logprob after the first, and the k most likely at its position (vLLM's
    # prompt_logprobs): the prompt is computed whole, never taken from the prefix cache.
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None
    speculative: bool = True  # False: never decode this request with drafts (the engine's speculative decoding)
    # vLLM's semantics: below min_tokens neither the end-of-sequence token nor a stop string ends a choice;
    # with ignore_eos the end-of-sequence token never does (max_new_tokens and stop strings still do).
    min_tokens: int = 0
    ignore_eos: bool = False

    @model_validator(mode="before")
    @classmethod
    def _strict(cls, data: Any) -> Any:
        # Checked before pydantic's coercion so that True, 2.0 and "3" are refused rather than converted.
        if not isinstance(data, dict):
            return data
        stop = data.get("stop", ())
        if isinstance(stop, str) or not isinstance(stop, tuple | list):
            raise ValueError(f"stop must be a tuple of strings, got {stop!r}")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop sequences must be non-empty strings, got {tuple(stop)!r}")
        for name in ("max_new_tokens", "n"):
            if name in data:
                _check_int(name, data[name], 1)
        for name in ("top_k", "min_tokens"):
            if name in data:
                _check_int(name, data[name], 0)
        if not isinstance(data.get("ignore_eos", False), bool):
            raise ValueError(f"ignore_eos must be true or false, got {data['ignore_eos']!r}")
        if data.get("seed") is not None:
            _check_int("seed", data["seed"], 0)
        for name in ("logprobs", "prompt_logprobs"):
            if data.get(name) is not None:
                _check_int(name, data[name], 0)
                if data[name] > MAX_TOP_LOGPROBS:
                    raise ValueError(f"{name} must be at most {MAX_TOP_LOGPROBS}, got {data[name]!r}")
        temperature = data.get("temperature", 1.0)
        if not _is_number(temperature) or not 0 <= temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
        top_p = data.get("top_p", 1.0)
        if not _is_number(top_p) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        penalty = data.get("repetition_penalty", 1.0)
        if not _is_number(penalty) or not 0 < penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {penalty!r}")
        return {**data, "stop": tuple(stop)}

    @model_validator(mode="after")
    def _seed_range(self) -> SamplingParams:
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            raise ValueError(f"seed + n - 1 must be at most {MAX_SEED}, got {self.seed + self.n - 1}")
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most the tokens to generate "
                             f"({self.max_new_tokens})")
        if self.constraint is not None and (self.min_tokens or self.ignore_eos):
            raise ValueError("min_tokens and ignore_eos cannot be combined with structured output: the grammar "
                             "decides where the output ends")
        return self

    @property
    def greedy(self) -> bool:
        """True when the argmax is taken (temperature 0): no randomness is consumed."""
        return self.temperature == 0


class ChatMessage(BaseModel):
    """One turn of a chat; the worker renders the turns with the model's own chat template."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, OpenAI's shape (core.tool_calls)
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None


class ValueBounds(BaseModel):
    """How long a string and how many digits a number of schema-constrained output may be where its schema leaves
    them open (the settings' structured_max_*; core.schema_bounds.bounded_schema takes them as its arguments)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_string_chars: int
    max_number_digits: int
    max_fraction_digits: int

    @classmethod
    def of(cls, settings: Settings) -> ValueBounds:
        """The server's bounds."""
        return cls(max_string_chars=settings.structured_max_string_chars,
                   max_number_digits=settings.structured_max_number_digits,
                   max_fraction_digits=settings.structured_max_fraction_digits)


class ChatOptions(BaseModel):
    """What a chat renders and constrains by beyond its messages: the tools and the template's own arguments."""

    model_config = ConfigDict(extra="forbid")

    tools: list[dict[str, Any]] | None = None  # checked by core.tool_calls.check_tools
    tool_choice: str = "none"  # "none", "auto", "required" or the one function's name
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = Field(default_factory=dict)  # chat_template_kwargs (enable_thinking)
    tool_bounds: ValueBounds | None = None  # the server's bounds on the calls' open strings and numbers


class GenerateTask(BaseModel):
    """The broker message for one generation request (API -> generation worker); `op` "tokenize" / "detokenize"
    asks only the model's tokenizer (the prompt's ids / prompt_ids' text), answered by one TokensEvent."""

    request_id: str
    op: Literal["generate", "tokenize", "detokenize"] = "generate"
    add_special_tokens: bool = True  # "tokenize": with the tokenizer's own special tokens (Llama's BOS), as prompts
    model: str  # the model's folder, hub id, or a job id (fetched from the artifact store), as resolved by the API
    adapter: str | None = None  # a LoRA adapter job's id: served over `model`, its base, in the base's batches
    tenant: str | None = None  # whose request: the engine shares its queue and rows between tenants
    prompt: str
    prompt_ids: list[int] | None = None  # the prompt as token ids, sent as such: `prompt` is then empty
    messages: list[ChatMessage] | None = None  # a chat: the prompt is rendered from these by the worker
    chat: ChatOptions | None = None  # a chat's tools and template arguments
    params: SamplingParams
    tokens_field: str = GENERATE.name  # the request's field that set params.max_new_tokens: errors name it
    deadline: float  # wall-clock time after which a worker drops the request unstarted

    def remaining(self) -> float:
        """Seconds left before the deadline (negative once it passed)."""
        return self.deadline - time.time()


class Token(BaseModel):
    """One token as logprobs name it: its text (invalid UTF-8 replaced) and its own bytes."""

    token: str
    bytes: list[int]


class TopLogprob(Token):
    """One candidate token and its log-probability."""

    logprob: float


class TokenLogprob(TopLogprob):
    """A sampled token's log-probability and the most likely alternatives at its step."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class TokenEvent(BaseModel):
    """Text decoded for one choice (with the logprobs of the tokens it came from, when asked for)."""

    type: Literal["token"] = "token"
    index: int
    text: str  # the content's delta
    logprobs: list[TokenLogprob] | None = None
    reasoning: str | None = None  # the thinking section's delta
    tool_calls: list[dict[str, Any]] | None = None  # tool-call deltas in OpenAI's streaming shape (with index)


class AcceptedEvent(BaseModel):
    """The worker validated the request and queued it on its engine."""

    type: Literal["accepted"] = "accepted"
    prompt_tokens: int


class PromptLogprobs(BaseModel):
    """A prompt scored by the model (SamplingParams.prompt_logprobs): its first token, which nothing precedes and so
    has no logprob, then each later token's logprob given the tokens before it, with the most likely there."""

    first: Token
    scored: list[TokenLogprob]


class ChoiceOut(BaseModel):
    """One finished continuation."""

    index: int
    text: str
    finish_reason: str  # "length" | "stop" | "eos" | "cancelled" | "tool_calls"
    logprobs: list[TokenLogprob] | None = None
    reasoning: str | None = None  # a chat's thinking section, apart from the text
    tool_calls: list[dict[str, Any]] | None = None  # a chat's calls: {"id", "type", "function": {name, arguments}}


class Usage(BaseModel):
    """Token counts of a request; `openai()` is OpenAI's usage object, as every /v1 answer carries it."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the engine's prefix cache
    reasoning_tokens: int = 0  # of completion_tokens, those of a chat's thinking sections (its text, tokenized)

    def openai(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class DoneEvent(BaseModel):
    """The request finished: every choice and the usage."""

    type: Literal["done"] = "done"
    choices: list[ChoiceOut]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # when params.prompt_logprobs asked for them
    prompt_text: str | None = None  # a prompt sent as token ids, decoded (echo shows it)


class TokensEvent(BaseModel):
    """A tokenizer's answer (GenerateTask.op): the ids and their text, and the model's context in tokens."""

    type: Literal["tokens"] = "tokens"
    ids: list[int]
    text: str
    context: int


class ErrorEvent(BaseModel):
    """The request failed; `error` is the envelope body."""

    type: Literal["error"] = "error"
    error: ErrorBody

    @classmethod
    def of(cls, code: str, message: str, field: str | None = None) -> ErrorEvent:
        """An error event from its parts."""
        return cls(error=ErrorBody(code=code, message=message, field=field))


GenerationEvent = Annotated[TokenEvent | AcceptedEvent | DoneEvent | TokensEvent | ErrorEvent,
                            Field(discriminator="type")]
EVENTS: TypeAdapter[GenerationEvent] = TypeAdapter(GenerationEvent)


def parse_event(raw: bytes | str) -> GenerationEvent:
    """A stream entry's JSON back into its event model."""
    return EVENTS.validate_json(raw)


class _Rank(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RankStart(_Rank):
    """on_start: sizes, labels, device and resume point."""

    kind: Literal["start"] = "start"
    info: dict[str, Any] = Field(default_factory=dict)


class RankLog(_Rank):
    """on_log: one optimizer step's train metrics."""

    kind: Literal["log"] = "log"
    step: int
    epoch: float
    metrics: dict[str, float] = Field(default_factory=dict)


class RankEval(_Rank):
    """on_eval: one evaluation's metrics."""

    kind: Literal["eval"] = "eval"
    step: int
    metrics: dict[str, float] = Field(default_factory=dict)


class RankCheckpoint(_Rank):
    """on_checkpoint: a checkpoint folder written at `step`."""

    kind: Literal["checkpoint"] = "checkpoint"
    step: int
    path: str


class RankBest(_Rank):
    """on_best: the evaluation at `step` is the best so far ({step, metric, value})."""

    kind: Literal["best"] = "best"
    step: int
    best: dict[str, Any]


class RankEvent(_Rank):
    """on_event: an engine event of the job's log (core.rows.EventKind)."""

    kind: Literal["event"] = "event"
    event: str
    message: str


class RankShouldStop(_Rank):
    """should_stop: a question; the launcher answers b"1" or b"0"."""

    kind: Literal["should_stop"] = "should_stop"


class RankStopReason(_Rank):
    """stop_reason: a question; the launcher answers the reason's text (empty: none)."""

    kind: Literal["stop_reason"] = "stop_reason"


class RankResult(_Rank):
    """The run's end: its status, steps, metrics, manifest, final model folder, stop reason and best evaluation."""

    kind: Literal["result"] = "result"
    status: str
    step: int
    total_steps: int
    metrics: dict[str, float] = Field(default_factory=dict)
    manifest: dict[str, Any] = Field(default_factory=dict)
    path: str | None = None
    stop_reason: str | None = None
    best: dict[str, Any] | None = None


class RankError(_Rank):
    """The run failed: the error's code (an engine's `code`, else training_error) and its text."""

    kind: Literal["error"] = "error"
    code: str = ErrorCode.TRAINING_ERROR
    message: str


RankMessage = Annotated[RankStart | RankLog | RankEval | RankCheckpoint | RankBest | RankEvent | RankShouldStop
                        | RankStopReason | RankResult | RankError, Field(discriminator="kind")]
"""What rank 0 of a multi-device training run tells the worker process that launched it: one message per engine
callback, or the run's end (result or error); each kind its own typed shape."""
RANK_MESSAGE: TypeAdapter[RankMessage] = TypeAdapter(RankMessage)


class WebhookPayload(BaseModel):
    """The body of every webhook delivery (Standard Webhooks shape: type, timestamp, data)."""

    type: str
    timestamp: datetime
    data: dict[str, Any]
