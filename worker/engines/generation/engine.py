"""Serve a decoder LM (GPT-2, Llama, Mistral, Qwen2/3): continuous batching over a shared KV cache, one scheduler
thread. GenerationEngine is the caller-facing client: it starts and stops that thread, validates and queues requests
(`submit`, thread-safe: the scheduler's queue under the engine's lock), hands out their futures and reports stats.
The thread runs the step loop (step_loop.py): each step the scheduler (scheduler.py) plans what starts, what
prefills in chunks (prefill.py) beside one decode step for all running sequences, and what drafts; the runner runs
it; the scheduler takes the outcome back; a finished sequence leaves at once and its row is reused. How a request
ends (finished, cancelled, timed out, failed) is endings.py's; a deadline only applies while a request waits
(DeadlineExceeded). Per-request sampling (sampling/), grammars (sampling/grammar.py), LoRA adapters of the base in
the same batches (lora_manager.py), one runner per architecture (runners/) holding the KV cache (caches/).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from core.protocol import SamplingParams
from worker.engines.device import DevicePlan, resolve_device
from worker.engines.generation.endings import Endings
from worker.engines.generation.lora_manager import LoraManager
from worker.engines.generation.requests import (
    AdapterUse,
    DeadlineExceeded,
    EngineClosed,
    GenerationResult,
    OnToken,
    QueueFull,
    Request,
    check_fits,
    prompt_ids,
)
from worker.engines.generation.runners.decoder import DecoderRunner, open_runner
from worker.engines.generation.runners.runner import Runner
from worker.engines.generation.sampling.grammar import Grammars
from worker.engines.generation.scheduler import Scheduler
from worker.engines.generation.step_loop import StepLoop
from worker.engines.generation.tokenizer import chat_ids, load_tokenizer

__all__ = ["DeadlineExceeded", "EngineClosed", "GenerationEngine", "GenerationResult", "QueueFull", "SamplingParams"]


class GenerationEngine:
    """A decoder LM loaded once, decoding many requests together; submit() is thread-safe.

    on_token(choice_index, text_delta) runs on the scheduler thread (keep it short); the deltas of a
    choice concatenate to its final text. A callback that raises fails its own request only.
    The client of a step loop (step_loop.py: the runner with its KV cache, the running rows) that the scheduler
    (queues, admission, prefill budget, drafts) plans for; grammars, and over a llama-family base the LoRA manager.
    """

    def __init__(
        self, model: str | Path, *, device: str = "auto", precision: str = "auto", max_batch_size: int = 32,
        max_tokens_in_flight: int = 16384, max_queue: int = 256, tenant_queue_share: float = 1.0,
        cancelled_ids: Callable[[list[str]], Collection[str]] | None = None,
        on_step: Callable[[int], None] | None = None, prefill_chunk_tokens: int = 2048, prefill_step_ratio: float = 1.5,
        prefix_cache_bytes: int = 0, decode_graphs: str = "off", max_loras: int = 8,
        adapter_folder: Callable[[str], Path] | None = None, speculative_tokens: int = 0,
        speculative_max_rows: int = 32, runner: str = "auto", prefix_cache_across_tenants: bool = False,
    ) -> None:
        self.scheduler = Scheduler(max_batch_size=max_batch_size, max_tokens_in_flight=max_tokens_in_flight,
                                   max_queue=max_queue, tenant_queue_share=tenant_queue_share,
                                   prefill_chunk_tokens=prefill_chunk_tokens, prefill_step_ratio=prefill_step_ratio,
                                   prefix_cache_bytes=prefix_cache_bytes, speculative_tokens=speculative_tokens,
                                   speculative_max_rows=speculative_max_rows,
                                   prefix_cache_across_tenants=prefix_cache_across_tenants)
        self.max_batch_size = max_batch_size
        self.prefix_cache_bytes = prefix_cache_bytes
        self.max_tokens_in_flight = max_tokens_in_flight
        self.max_queue = max_queue
        self.max_loras = max_loras
        self.speculative_tokens, self.speculative_max_rows = speculative_tokens, speculative_max_rows
        self.runner_choice = runner  # "auto": by the model's type (runners/decoder.open_runner); "general"
        self._encode_lock = threading.Lock()  # HF fast tokenizers are not safe to call from many threads
        self._lock = threading.RLock()  # the scheduler's queue, the loop's rows and the counters
        self._closed = False
        self._endings = Endings(self._lock)
        # The model loads on the scheduler thread, the one thread that computes with it. On a CPU every thread that
        # runs an OpenMP parallel region keeps a team of worker threads; once a process holds more of them than it
        # has cores, GNU OpenMP's workers stop spinning between regions and sleep, and each of a decode step's
        # hundreds of small regions pays a wake-up (a 16-row step measured 1.3-1.7x slower with the model loaded on
        # the caller's thread and stepped on this one).
        loaded: Future[StepLoop] = Future()
        self._thread = threading.Thread(target=self._serve, args=(loaded, model, device, precision, decode_graphs,
                                                                   adapter_folder, cancelled_ids, on_step),
                                        name="generation-scheduler", daemon=True)
        self._thread.start()
        self._loop = loaded.result()  # a load error (a missing folder, an unsupported architecture) raises here

    def _serve(self, loaded: Future[StepLoop], model: str | Path, device: str, precision: str, decode_graphs: str,
               adapter_folder: Callable[[str], Path] | None,
               cancelled_ids: Callable[[list[str]], Collection[str]] | None,
               on_step: Callable[[int], None] | None) -> None:
        """The scheduler thread: load the model, then run the step loop until close()."""
        try:
            self._load(model, device, precision, adapter_folder)
            loop = StepLoop(self._runner, self.scheduler, self._endings, self._lock, tokenizer=self.tokenizer,
                            device=torch.device(self.plan.device), lora=self.lora, decode_graphs=decode_graphs,
                            cancelled_ids=cancelled_ids, on_step=on_step)
        except BaseException as error:  # noqa: BLE001 - handed to the constructor, which raises it
            loaded.set_exception(error)
            return
        loaded.set_result(loop)
        loop.run()

    def _load(self, model: str | Path, device: str, precision: str,
              adapter_folder: Callable[[str], Path] | None) -> None:
        """The runner (weights and KV cache), tokenizer, grammars and adapters: on the scheduler thread (see
        __init__)."""
        self.plan: DevicePlan = resolve_device(device, precision, generation=True)
        self._runner: Runner = open_runner(model, self.plan, max_rows=self.max_batch_size, runner=self.runner_choice)
        self.tokenizer = load_tokenizer(model)
        self.config = self._runner.config
        self.context_length: int = self._runner.max_length
        self.vocab_size: int = self.config.vocab_size
        self.eos_token_ids = self._runner.eos_token_ids  # generation_config.json's (one id or a list)
        # GPT-2 has no adapter path here: its adapter requests are refused (serve the merged model instead).
        self.lora: LoraManager | None = None
        if isinstance(self._runner, DecoderRunner):
            self.lora = LoraManager(self._runner, max_loras=self.max_loras, adapter_folder=adapter_folder or Path)
        self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)

    # -- the callers' side --

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt with the tokenizer's own special tokens (Llama's BOS; none for GPT-2), as vLLM does."""
        with self._encode_lock:
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    **template_kwargs: Any) -> list[int]:
        """Prompt ids of a chat through the model's own chat template (NoChatTemplate when it has none)."""
        with self._encode_lock:
            return chat_ids(self.tokenizer, messages, tools, **template_kwargs)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids, special tokens included (an echoed prompt, /detokenize)."""
        with self._encode_lock:
            return str(self.tokenizer.decode(list(ids)))

    def read_adapter(self, name: str) -> AdapterUse:
        """Adapter `name` for a request, read now unless resident (ValueError if this base cannot serve it)."""
        if self.lora is None:
            raise ValueError(f"adapter {name!r}: adapters are served over llama-family bases "
                             f"({self.config.model_type} is not one); serve the merged model instead")
        return self.lora.use(name)

    def submit(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, *, request_id: str | None = None,
        on_token: OnToken | None = None, is_cancelled: Callable[[], bool] | None = None,
        deadline: float | None = None, adapter: str | AdapterUse | None = None, tenant: str | None = None,
        batch: bool = False,
    ) -> Future[GenerationResult]:
        """Queue a request; the future resolves to its GenerationResult. Raises ValueError, QueueFull.

        adapter: a LoRA adapter of this base, by name (its folder read here, on the caller's thread, unless
        resident); tenant: whose request (the scheduler's fair share); batch: a /v1/batches line (after
        interactive requests).
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = prompt_ids(prompt, self.encode, self.vocab_size)
        check_fits(len(ids), params, context_length=self.context_length, max_batch_size=self.max_batch_size,
                   max_tokens_in_flight=self.max_tokens_in_flight)
        use = self.read_adapter(adapter) if isinstance(adapter, str) else adapter
        request = Request(request_id or uuid.uuid4().hex, ids, params, on_token, is_cancelled, deadline,
                          adapter=use, tenant=tenant, batch=batch)
        if params.constraint is not None:  # compiled here, on the caller's thread: off the decode loop
            request.matchers = [self._grammars.matcher(params.constraint) for _ in range(params.n)]
        with self._lock:
            if self._closed:
                raise EngineClosed("the generation engine is closed")
            if deadline is not None and deadline <= time.monotonic():
                self._endings.expire(request, f"request {request.request_id}: deadline already passed")
                return request.future
            self.scheduler.add(request)
            self._loop.wake()
        return request.future

    @property
    def weight_bytes(self) -> int:
        """Bytes of model weights the engine holds (packed copies replace the originals, so each counts once), with
        the adapter slots' stacks."""
        return self._runner.weight_bytes + (self.lora.nbytes if self.lora is not None else 0)

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> GenerationResult:
        """Submit and wait for the result."""
        return self.submit(prompt, params).result()

    def stats(self) -> dict[str, Any]:
        """Queue and batch occupancy plus running totals."""
        with self._lock:
            return {**self._loop.occupancy(), **self.scheduler.stats(),
                    "max_batch_size": self.max_batch_size, "max_tokens_in_flight": self.max_tokens_in_flight,
                    "closed": self._closed,
                    "adapters": self.lora.resident() if self.lora is not None else [], "max_loras": self.max_loras,
                    **self._endings.counters}

    def alive(self) -> bool:
        """Whether the scheduler thread still runs and the engine is not closed."""
        return not self._closed and self._thread.is_alive()

    def close(self) -> None:
        """Stop the scheduler; requests still waiting or running fail with EngineClosed."""
        with self._lock:
            self._closed = True
        self._loop.stop()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> GenerationEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
