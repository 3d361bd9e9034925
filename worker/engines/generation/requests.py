"""What the generation engine tracks: a request, its sequences (one per choice) and their results."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.generation_limits import fit_refusal
from core.protocol import PromptLogprobs, SamplingParams, TokenLogprob
from worker.engines.generation.lora.adapter_cache import LoraWeights
from worker.engines.generation.sampling.detokenize import Pieces
from worker.engines.generation.sampling.sampler import row_seed
from worker.engines.generation.sampling.text_stream import TextStream

if TYPE_CHECKING:
    from llguidance import LLMatcher

# The finish reason of a constrained sequence whose grammar matcher failed mid-way (its mask then allows only the end
# of sequence): reported to the client as an error, never as a "stop" with truncated output.
GRAMMAR_ERROR = "grammar_error"

# on_token(choice index, text delta); a request with params.logprobs set gets a third argument, the logprobs
# of the tokens that delta came from (a held-back delta's tokens arrive with the next one).
OnToken = Callable[..., None]


class QueueFull(RuntimeError):
    """The waiting queue, or the tenant's share of it, has no room for the request's rows."""


class DeadlineExceeded(TimeoutError):
    """The request was still waiting for a batch slot when its deadline passed."""


class EngineClosed(RuntimeError):
    """The engine was closed before the request finished."""


@dataclass
class Choice:
    """One generated continuation; token_ids include the eos id when finish_reason is "eos"."""

    index: int
    text: str
    finish_reason: str  # "length" | "stop" | "eos" | "cancelled" | GRAMMAR_ERROR
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per generated token (not the eos), when asked for


@dataclass
class GenerationResult:
    """The choices of one request and its token usage."""

    request_id: str
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int  # sum over choices
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: PromptLogprobs | None = None  # the prompt scored, when params.prompt_logprobs asked for it


@dataclass(eq=False)
class AdapterUse:
    """A request's LoRA adapter: its name, its weights when read before submitting, its slot once admitted."""

    name: str
    weights: LoraWeights | None = None  # read off the decode loop; None when it was resident already
    slot: int = 0  # 0: the base (no adapter slot yet)


@dataclass(eq=False)
class Request:
    """One submitted request: its prompt ids, sampling settings, callbacks and future."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    on_token: OnToken | None
    is_cancelled: Callable[[], bool] | None
    deadline: float | None
    future: Future = field(default_factory=Future)
    sequences: list[SequenceState] = field(default_factory=list)
    done: bool = False
    matchers: list[LLMatcher] = field(default_factory=list)  # one grammar matcher per choice when constrained
    adapter: AdapterUse | None = None  # a LoRA adapter over the engine's base model (lora_manager.py)
    tenant: str | None = None  # whose request: the scheduler shares rows and the queue between tenants
    batch: bool = False  # a /v1/batches line: admitted after interactive requests
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (prefix_cache.py)
    prefix: list[int] = field(default_factory=list)  # their blocks in the paged cache, held until restored
    prompt_logprobs: PromptLogprobs | None = None  # filled chunk by chunk as the prompt prefills, when asked for

    def result(self) -> GenerationResult:
        """The outcome from its sequences; a request dropped before it started has empty cancelled choices."""
        if not self.sequences:
            return GenerationResult(self.request_id, [Choice(i, "", "cancelled", []) for i in range(self.params.n)],
                                    len(self.prompt), 0, self.cached_tokens)
        choices = [Choice(s.index, s.stream.text, s.finish_reason or "cancelled", list(s.tokens), s.logprobs)
                   for s in self.sequences]
        return GenerationResult(self.request_id, choices, len(self.prompt), sum(len(c.token_ids) for c in choices),
                                self.cached_tokens, self.prompt_logprobs)

    def start(self) -> bool:
        """Mark the request running as it is admitted (its future can no longer be cancelled); False when its caller
        cancelled the future first."""
        return self.future.set_running_or_notify_cancel()

    def open(self, pieces: Callable[[], Pieces]) -> list[SequenceState]:
        """Create the request's n sequences, each with its own seed (seed + index when seeded) and text decoder."""
        for index in range(self.params.n):
            self.sequences.append(SequenceState(
                self, index, TextStream(pieces(), self.params.stop), row_seed(self.params, index),
                matcher=self.matchers[index] if self.matchers else None,
                logprobs=[] if self.params.logprobs is not None else None))
        return self.sequences

    def cancel(self) -> list[tuple[int, str]]:
        """Finish every unfinished sequence as "cancelled"; returns (choice index, text still to emit) pairs."""
        pending = []
        for sequence in self.sequences:
            if sequence.finish_reason is None:
                sequence.finish_reason = "cancelled"
                pending.append((sequence.index, sequence.stream.finish()))
        return [(index, delta) for index, delta in pending if delta]

    @property
    def cost(self) -> int:
        """Cache positions the request may occupy: its share of max_tokens_in_flight."""
        return self.params.n * (len(self.prompt) + self.params.max_new_tokens)


@dataclass(eq=False)
class SequenceState:
    """One choice of a request, decoding in one row of the batch."""

    request: Request
    index: int
    stream: TextStream
    seed: int | None  # None when greedy
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    matcher: LLMatcher | None = None  # a constrained sequence's grammar matcher, advanced by every accepted token
    logprobs: list[TokenLogprob] | None = None
    unsent: list[TokenLogprob] = field(default_factory=list)  # logprobs not yet streamed with a text delta
    # Draft tokens this row kept, and those the rates expected it to keep (decayed): speculative.DraftRates' scale.
    draft_kept: float = 0.0
    draft_expected: float = 0.0

    @property
    def position(self) -> int:
        """Where the last sampled token goes when it is fed back to the model."""
        return len(self.request.prompt) + len(self.tokens) - 1

    def accept(self, token: int, eos_ids: frozenset[int]) -> str:
        """Append a sampled token, decide whether the sequence is finished; returns the text to emit."""
        self.tokens.append(token)
        if self.matcher is not None:
            self.matcher.consume_token(token)
            if self.matcher.is_error():  # its mask allowed only eos from here: end as an error, never as a "stop"
                self.finish_reason = GRAMMAR_ERROR
                return self.stream.finish()
        params = self.request.params
        # vLLM's counts: the eos token may end a choice holding min_tokens tokens before it, and stop strings are
        # looked for once min_tokens tokens are out.
        if token in eos_ids and not (params.ignore_eos or len(self.tokens) <= params.min_tokens):
            self.finish_reason = "eos"
            return self.stream.finish()  # the eos token has no text
        self.stream.stops_armed = len(self.tokens) >= params.min_tokens
        delta = self.stream.push(token)
        if self.stream.stopped:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.request.params.max_new_tokens:
            self.finish_reason = "length"
            delta += self.stream.finish()
        return delta


    def take_unsent(self) -> list[TokenLogprob]:
        """The logprobs gathered since the last streamed delta."""
        unsent, self.unsent = self.unsent, []
        return unsent


def prompt_ids(prompt: str | Sequence[int], encode: Callable[[str], list[int]], vocab_size: int) -> list[int]:
    """A prompt as token ids; ValueError for an empty prompt or ids outside the vocabulary."""
    if isinstance(prompt, str):
        ids = encode(prompt) if prompt else []
    elif isinstance(prompt, list | tuple):
        ids = list(prompt)
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}), got {bad[:5]!r}")
    else:
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt is empty")
    return ids


def check_fits(prompt_tokens: int, params: SamplingParams, *, context_length: int, max_batch_size: int,
               max_tokens_in_flight: int) -> None:
    """ValueError when a request can never run on this engine (core.generation_limits.fit_refusal)."""
    refusal = fit_refusal(prompt_tokens, params, context_length=context_length, max_batch_size=max_batch_size,
                          max_tokens_in_flight=max_tokens_in_flight)
    if refusal is not None:
        raise ValueError(refusal.message)
