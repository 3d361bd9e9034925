"""What the engine needs of a serving runner, whatever the architecture (runners/gpt2.py, runners/decoder.py)."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from worker.engines.generation.caches.paged_cache import PagedCache
from worker.engines.generation.lora.runner_lora import RunnerLora


class DecodeInput(NamedTuple):
    """A decode step for rows 0..B-1: their last tokens [B], their positions [B], the span attention covers and,
    from a CUDA graph's static buffers, their block table [B, span / BLOCK] already prepared (else built here).

    `rows`: the cache row of each token where that is not token b's row b: a speculative step checks a row's last
    token and its draft as tokens of their own at consecutive positions, each reading the row up to its position.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    span: int
    table: torch.Tensor | None = None
    rows: list[int] | None = None


class PrefillInput(NamedTuple):
    """Prompt chunks: their token ids, the cache rows each fills (n choices share one prefill), where each begins
    and which of them (by index) need logits at every position (a prompt scored: SamplingParams.prompt_logprobs)."""

    prompts: list[list[int]]
    rows: list[list[int]]
    starts: list[int]
    scored: tuple[int, ...] = ()


class Runner(Protocol):
    """One architecture's forward pass over the KV cache it holds (it is given a cache, it is not one)."""

    config: Any  # the checkpoint's transformers config (vocab_size, model_type, ...)
    eos_token_ids: frozenset[int]
    device: torch.device
    dtype: torch.dtype
    max_rows: int
    max_length: int  # the model's context
    cache: PagedCache
    lora: RunnerLora | None  # per-row adapters, where the architecture has an adapter path

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights the runner holds."""
        ...

    def forward(self, decode: DecodeInput | None, prefill: PrefillInput | None) -> torch.Tensor:
        """A decode step for rows 0..B-1 and the prefill of prompt chunks in one pass: logits [B + P, V], then
        those of every position of each scored chunk, in order (PrefillLayout.picked)."""
        ...
