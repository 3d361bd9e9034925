"""The one interface a generation worker serves through, whichever engine decodes.

Two engines implement it: trainserve's own (generation/engine.GenerationEngine: continuous batching in this
process, the default on a CPU and the embedded default) and vLLM (vllm/engine.VllmEngine: a vLLM server the
engine starts, for GPU hosts, tensor parallelism and any architecture vLLM serves). The worker's generation server
(worker/servers/generation.py) renders chats, constrains tool calls, parses answers and writes events the same way
for both; an engine only decodes what it is given.

The contract both keep:
- `encode` / `encode_chat`: prompt ids with the tokenizer's own special tokens / through the model's chat template;
  `decode`: ids back to text, special tokens included.
- `submit(ids, params, request_id=, on_token=, deadline=, adapter=, tenant=, batch=)` returns a future of a
  GenerationResult; on_token(choice, text delta[, logprobs]) streams. ValueError for a request this engine can
  never run (its message names what is wrong; a GrammarError also the request field), QueueFull when the queue or
  the tenant's share of it is full (429), DeadlineExceeded when it waited past its deadline (504), EngineClosed.
- Cancel: `cancelled_ids` (given at construction) names the requests whose callers went away; they end "cancelled".
- `read_adapter(name)`: a LoRA adapter of this base, loaded (ValueError when this engine cannot serve it).
- `stats()`: occupancy and counters; `weight_bytes` and `prefix_cache_bytes`: what an idle engine holds;
  `alive()`: False once it cannot serve (the worker's registry then loads the model again).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from core.protocol import SamplingParams
from worker.engines.generation.requests import AdapterUse, GenerationResult, OnToken


class ServingEngine(Protocol):
    """What the generation worker needs of an engine."""

    tokenizer: Any
    vocab_size: int
    context_length: int
    max_batch_size: int
    max_tokens_in_flight: int
    prefix_cache_bytes: int

    @property
    def weight_bytes(self) -> int: ...

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    **template_kwargs: Any) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def read_adapter(self, name: str) -> AdapterUse: ...

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               request_id: str | None = None, on_token: OnToken | None = None,
               is_cancelled: Callable[[], bool] | None = None, deadline: float | None = None,
               adapter: str | AdapterUse | None = None, tenant: str | None = None,
               batch: bool = False) -> Future[GenerationResult]: ...

    def stats(self) -> dict[str, Any]: ...

    def alive(self) -> bool:
        """Whether it can still serve (False once closed, or once vLLM's server or engine core died)."""
        ...

    def close(self) -> None: ...
