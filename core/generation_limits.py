"""Generation limits, each decided here once and read by every route, batch line, eval run, judge and the CLI.

A request asks for its generated tokens in its own shape's field, with its own default (a /v1/batches line is the
shape of its url):

    POST /generate                      max_new_tokens                                        16
    POST /v1/completions                max_tokens                                            16 (OpenAI's)
    POST /v1/chat/completions           max_completion_tokens, or the older max_tokens        256
    an eval run's completions source    data_source.sampling_params.max_completion_tokens     256 (as a chat)
    a model grader's judge              sampling_params.max_completions_tokens (sic, OpenAI's) 64 (one small JSON)

Every bound names the field the client sent (the shape's first field when it sent none): a chat is never told
about /generate's max_new_tokens. The bounds, in the order a request meets them:

1. the schemas' hard bound MAX_TOKENS_BOUND, the same on every server (pydantic's 422);
2. the server's, checked by the API before anything is queued (server_refusal): its cap Settings.max_new_tokens (at
   most MAX_TOKENS_BOUND) and the response size Settings.max_response_entries (n x tokens x (1 + top_logprobs));
3. the engine's, once the worker has the prompt's tokens (fit_refusal): the model's context, the rows decoded
   together (Settings.max_batch_size) and the cache positions in flight (Settings.max_tokens_in_flight).

A check returns a Refusal (the field, the message) or None and its caller raises it in its own channel: a
ValidationFailed in the API, an error event from the generation worker, a batch line's error, the engine's
ValueError. Imports nothing of core, so that core.protocol and core.settings can read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

MAX_TOKENS_BOUND = 8192  # the most generated tokens any schema accepts; a server's cap is at most this


@dataclass(frozen=True)
class TokenField:
    """How one request shape asks for its generated-token count: the field(s) it may send and its default."""

    names: tuple[str, ...]  # in precedence order; the first is the one named when the client sent none
    default: int

    @property
    def name(self) -> str:
        """The shape's own field: named when the client sent none."""
        return self.names[0]

    def chosen(self, sent: Mapping[str, int | None]) -> tuple[int, str]:
        """The count asked for and the field the client sent it in: the first of `names` sent, else the default
        and `name`."""
        for name in self.names:
            count = sent.get(name)
            if count is not None:
                return count, name
        return self.default, self.name


GENERATE = TokenField(("max_new_tokens",), 16)
COMPLETIONS = TokenField(("max_tokens",), 16)  # OpenAI's default
CHAT = TokenField(("max_completion_tokens", "max_tokens"), 256)  # max_tokens: deprecated by OpenAI, still sent
EVAL_RUN = TokenField(("data_source.sampling_params.max_completion_tokens",), CHAT.default)  # as the chat it runs
JUDGE = TokenField(("sampling_params.max_completions_tokens",), 64)  # a judge's answer is one small JSON object


class Refusal(NamedTuple):
    """Why a request cannot run: the field at fault (as the client spelled it) and a message naming it."""

    field: str
    message: str


class Asked(Protocol):
    """What the limits read of a request's decoding (core.protocol.SamplingParams is one)."""

    @property
    def max_new_tokens(self) -> int: ...

    @property
    def n(self) -> int: ...

    @property
    def logprobs(self) -> int | None: ...


class ServerLimits(Protocol):
    """The server's generation limits (core.settings.Settings is one)."""

    @property
    def max_new_tokens(self) -> int: ...

    @property
    def max_response_entries(self) -> int: ...


def cap_refusal(tokens: int, field: str, cap: int) -> Refusal | None:
    """More tokens asked for (in `field`) than this server generates, or None."""
    if tokens <= cap:
        return None
    return Refusal(field, f"{field} must be at most {cap} on this server, got {tokens}")


def server_refusal(params: Asked, field: str, limits: ServerLimits) -> Refusal | None:
    """The server's cap, then the response size: what a request asking for params.max_new_tokens in `field` is
    refused for before anything is queued, or None."""
    over = cap_refusal(params.max_new_tokens, field, limits.max_new_tokens)
    if over is not None:
        return over
    top = params.logprobs or 0
    entries = params.n * params.max_new_tokens * (1 + top)
    if entries <= limits.max_response_entries:
        return None
    return Refusal(field, f"n ({params.n}) x {field} ({params.max_new_tokens}) x (1 + top_logprobs {top}) = "
                          f"{entries} token entries; a response holds at most {limits.max_response_entries} on this "
                          "server")


def fit_refusal(prompt_tokens: int, params: Asked, *, context_length: int, max_batch_size: int,
                max_tokens_in_flight: int, field: str = GENERATE.name) -> Refusal | None:
    """Why a prompt of `prompt_tokens` and its decoding can never run on an engine (the model's context, the rows
    decoded together, the cache positions in flight), or None when it fits."""
    total = prompt_tokens + params.max_new_tokens
    if total > context_length:
        return Refusal(field, f"prompt ({prompt_tokens} tokens) + {field} ({params.max_new_tokens}) = {total} "
                              f"exceeds the model's context length of {context_length}")
    if params.n > max_batch_size:
        return Refusal("n", f"n={params.n} exceeds max_batch_size={max_batch_size}")
    if params.n * total > max_tokens_in_flight:
        return Refusal(field, f"n * (prompt + {field}) = {params.n * total} exceeds "
                              f"max_tokens_in_flight={max_tokens_in_flight}")
    return None
