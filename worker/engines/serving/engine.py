"""Serve a decoder LM (GPT-2, Llama, Mistral, Qwen2/3): continuous batching over a shared KV cache, one scheduler
thread. Threads call `submit`; the scheduler thread owns the model. Each loop it admits waiting requests (FIFO) while
the batch has room, prefills their prompts into free cache rows, then runs one decode step for all running sequences;
a finished sequence leaves at once and its row is reused. A cancelled request (is_cancelled() polled before every
step, or named by the cancelled_ids hook once per step) resolves with finish_reason "cancelled" and the text so far;
a deadline only applies while a request waits (DeadlineExceeded). Per-request sampling; adapters: lora_engine.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from core.protocol import SamplingParams
from worker.engines.device import DevicePlan, resolve_device
from worker.engines.serving.caches.prefix_cache import PrefixCache
from worker.engines.serving.outcomes import RequestOutcomes
from worker.engines.serving.prefill import Chunk, ChunkBudget, PrefillQueue, chunk_groups
from worker.engines.serving.requests import (
    AdapterUse,
    DeadlineExceeded,
    EngineClosed,
    GenerationResult,
    OnToken,
    QueueFull,
    Request,
    SequenceState,
    check_fits,
    prompt_ids,
)
from worker.engines.serving.runners.cuda_graphs import static_decoder, static_eligible
from worker.engines.serving.runners.decoder import open_runner
from worker.engines.serving.runners.gpt2 import load_tokenizer
from worker.engines.serving.sampling.detokenize import logprob_table, piece_decoders
from worker.engines.serving.sampling.grammar import Grammars
from worker.engines.serving.sampling.row_outputs import chat_ids, constrained_logits, record_logprobs
from worker.engines.serving.sampling.sampler import RowParams, next_tokens

__all__ = ["DeadlineExceeded", "EngineClosed", "GenerationEngine", "GenerationResult", "QueueFull", "SamplingParams"]

class GenerationEngine(RequestOutcomes):
    """A decoder LM loaded once, decoding many requests together; submit() is thread-safe.

    on_token(choice_index, text_delta) runs on the scheduler thread (keep it short); the deltas of a
    choice concatenate to its final text. A callback that raises fails its own request only.
    """

    def __init__(
        self, model: str | Path, *, device: str = "auto", precision: str = "auto", max_batch_size: int = 32,
        max_tokens_in_flight: int = 16384, max_queue: int = 256,
        cancelled_ids: Callable[[list[str]], Collection[str]] | None = None,
        on_step: Callable[[int], None] | None = None, prefill_chunk_tokens: int = 2048, prefill_step_ratio: float = 1.5,
        prefix_cache_bytes: int = 0, decode_graphs: str = "off",
    ) -> None:
        for name, value in (("max_batch_size", max_batch_size), ("max_tokens_in_flight", max_tokens_in_flight),
                            ("max_queue", max_queue)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, value in (("prefill_chunk_tokens", prefill_chunk_tokens), ("prefix_cache_bytes", prefix_cache_bytes)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be 0 (off) or a positive integer, got {value!r}")
        if not isinstance(prefill_step_ratio, int | float) or not (prefill_step_ratio == 0 or prefill_step_ratio > 1):
            raise ValueError(f"prefill_step_ratio must be 0 (fixed chunks) or above 1, got {prefill_step_ratio!r}")
        self.plan: DevicePlan = resolve_device(device, precision, generation=True)
        self._runner = open_runner(model, self.plan, max_rows=max_batch_size)  # GPT-2 or a llama-family decoder
        self.tokenizer = load_tokenizer(model)
        self.config = self._runner.config
        self.context_length: int = self._runner.max_length
        self.vocab_size: int = self.config.vocab_size
        self.eos_token_ids = self._runner.eos_token_ids  # generation_config.json's (one id or a list)
        self.max_batch_size = max_batch_size
        self.max_tokens_in_flight = max_tokens_in_flight
        self.max_queue = max_queue
        # Given the ids of all waiting and running requests, those to drop: one call per loop (raising fails the batch).
        self._cancelled_ids = cancelled_ids
        # Told the batch size of every decode step (the worker's metrics); runs on the scheduler thread.
        self._on_step = on_step
        self._pieces = piece_decoders(self.tokenizer, self.vocab_size)
        self._table = logprob_table(self.tokenizer, self.vocab_size)  # each token's bytes, for logprobs
        self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._device = torch.device(self.plan.device)
        self._encode_lock = threading.Lock()  # HF fast tokenizers are not safe to call from many threads
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._waiting: deque[Request] = deque()
        self._tokens_in_flight = 0
        self._closed = False
        self._counters = {"steps": 0, "prefills": 0, "prompt_tokens": 0, "generated_tokens": 0,
                          "completed": 0, "cancelled": 0, "expired": 0, "failed": 0, "peak_running_sequences": 0}
        # Scheduler-thread state: rows of the batch, in cache-row order.
        self._rows: list[SequenceState] = []
        # Started requests whose prompts are still going into the cache, in chunks sized by _budget (prefill.py).
        # With prefix_cache_bytes, the KV of shared prompt prefixes is reused (prefix_cache.py).
        self._prefilling = PrefillQueue(PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None)
        self._budget = ChunkBudget(prefill_chunk_tokens or None, prefill_step_ratio)
        self._row_params: RowParams | None = None
        # Tokens seen per row (prompt + generated), for the repetition penalty: [max_batch_size, vocab].
        self._seen = torch.zeros(max_batch_size, self.vocab_size, dtype=torch.bool, device=self._device)
        # decode_graphs "cuda": plain decode steps replay CUDA graphs on a GPU (cuda_graphs.py); "eager": uncaptured
        self._static = static_decoder(decode_graphs, self._runner, self._seen)
        self._thread = threading.Thread(target=self._run, name="generation-scheduler", daemon=True)
        self._thread.start()

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a prompt with the tokenizer's own special tokens (Llama's BOS; none for GPT-2), as vLLM does."""
        with self._encode_lock:
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt ids of a chat through the model's own chat template (NoChatTemplate when it has none)."""
        with self._encode_lock:
            return chat_ids(self.tokenizer, messages)

    def submit(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, *, request_id: str | None = None,
        on_token: OnToken | None = None, is_cancelled: Callable[[], bool] | None = None,
        deadline: float | None = None, adapter: AdapterUse | None = None,
    ) -> Future[GenerationResult]:
        """Queue a request; the future resolves to its GenerationResult. Raises ValueError, QueueFull."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = prompt_ids(prompt, self.encode, self.vocab_size)
        check_fits(len(ids), params, context_length=self.context_length, max_batch_size=self.max_batch_size,
                   max_tokens_in_flight=self.max_tokens_in_flight)
        request = Request(request_id or uuid.uuid4().hex, ids, params, on_token, is_cancelled, deadline,
                          adapter=adapter)
        if params.constraint is not None:  # compiled here, on the caller's thread: off the decode loop
            request.matchers = [self._grammars.matcher(params.constraint) for _ in range(params.n)]
        with self._lock:
            if self._closed:
                raise EngineClosed("the generation engine is closed")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (max_queue={self.max_queue})")
            if deadline is not None and deadline <= time.monotonic():
                self._counters["expired"] += 1
                request.future.set_exception(DeadlineExceeded(f"request {request.request_id}: deadline already passed"))
                return request.future
            self._waiting.append(request)
            self._wake.notify()
        return request.future

    @property
    def weight_bytes(self) -> int:
        """Bytes of model weights the engine holds (packed copies replace the originals, so each counts once)."""
        return self._runner.weight_bytes

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> GenerationResult:
        """Submit and wait for the result."""
        return self.submit(prompt, params).result()

    def stats(self) -> dict:
        """Queue and batch occupancy plus running totals."""
        with self._lock:
            rows = list(self._rows)
            rows_cap, positions_cap = self._runner.capacity
            return {"running": len({id(s.request) for s in rows}), "running_sequences": len(rows),
                    "waiting": len(self._waiting), "prefilling": len(self._prefilling.requests),
                    "tokens_in_flight": self._tokens_in_flight,
                    "max_batch_size": self.max_batch_size, "max_tokens_in_flight": self.max_tokens_in_flight,
                    "cache_rows": rows_cap, "cache_positions": positions_cap, "closed": self._closed,
                    "prefill_budget_tokens": self._budget.tokens(decoding=True),  # beside running streams now
                    **self._counters}

    def close(self) -> None:
        """Stop the scheduler; requests still waiting or running fail with EngineClosed."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> GenerationEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        with torch.inference_mode():
            while self._wait_for_work():
                try:
                    flagged = self._flagged()
                    self._start(self._admit(flagged))
                    self._poll_cancelled(flagged)
                    decoding = bool(self._rows)
                    chunks = self._prefilling.plan(self._budget.tokens(decoding))
                    if decoding or chunks:
                        started = time.perf_counter()
                        self._step(chunks)
                        self._budget.observe(time.perf_counter() - started, decoding,
                                             sum(c.end - c.start for c in chunks))
                except Exception as error:  # noqa: BLE001 - a failed forward fails its batch, not the engine
                    self._reset(error)
        self._shutdown()

    def _wait_for_work(self) -> bool:
        with self._lock:
            while not self._closed and not self._waiting and not self._rows and not self._prefilling.requests:
                self._runner.release()  # idle: give the cache back (it may have grown for one long request)
                self._wake.wait()
            return not self._closed

    def _flagged(self) -> frozenset[str]:
        """Ids the cancelled_ids hook names among waiting and running requests (one call for all of them)."""
        with self._lock:
            ids = list(dict.fromkeys([r.request_id for r in [*self._waiting, *self._prefilling.requests]]
                                     + [q.request.request_id for q in self._rows]))
        return frozenset(self._cancelled_ids(ids)) if self._cancelled_ids is not None and ids else frozenset()

    def _admit(self, flagged: frozenset[str] = frozenset()) -> list[Request]:
        """Pop waiting requests in order while the batch has room; drop expired and cancelled ones first."""
        with self._lock:
            watched = [r for r in self._waiting
                       if r.is_cancelled is not None or r.future.cancelled() or r.request_id in flagged]
        # is_cancelled is caller code: polled without holding the lock.
        gone = {id(r) for r in watched if r.future.cancelled() or self._cancelled(r, flagged)}
        now = time.monotonic()
        admitted: list[Request] = []
        with self._lock:
            cancelled = [r for r in self._waiting if id(r) in gone]
            expired = [r for r in self._waiting if r.deadline is not None and r.deadline < now and id(r) not in gone]
            if cancelled or expired:
                dropped = gone | {id(r) for r in expired}
                self._waiting = deque(r for r in self._waiting if id(r) not in dropped)
                self._counters["expired"] += len(expired)
                self._counters["cancelled"] += len(cancelled)
            rows = len(self._rows) + self._prefilling.rows
            while self._waiting:
                head = self._waiting[0]
                # FIFO: a large request at the head waits for room rather than being overtaken forever.
                if rows + head.params.n > self.max_batch_size or \
                        self._tokens_in_flight + head.cost > self.max_tokens_in_flight:
                    break
                self._waiting.popleft()
                rows += head.params.n
                self._tokens_in_flight += head.cost
                admitted.append(head)
        for request in expired:
            request.future.set_exception(DeadlineExceeded(f"request {request.request_id} waited past its deadline"))
        for request in cancelled:
            if not request.future.cancelled() and not request.done:
                request.done = True
                request.future.set_result(request.result())
        return admitted

    def _start(self, admitted: list[Request]) -> None:
        """Queue admitted requests for prefill (those cancelled meanwhile give their cache positions back)."""
        for request in admitted:
            if request.future.set_running_or_notify_cancel():
                self._prefilling.add(request)
            else:
                with self._lock:
                    self._tokens_in_flight -= request.cost

    def _abort(self, requests: list[Request], error: BaseException) -> None:
        self._prefilling.remove(requests)
        for request in requests:
            self._fail(request, error)
            if not request.sequences:
                with self._lock:
                    self._tokens_in_flight -= request.cost
        try:
            self._sweep()
        except Exception:  # noqa: BLE001
            self._reset(error)

    def _step(self, chunks: list[Chunk]) -> None:
        """One decode step for every running row with the prefill of `chunks` (one pass); ended prompts sample."""
        first = len(self._rows)
        if chunks:
            try:
                self._open(chunks)
            except Exception as error:  # noqa: BLE001 - e.g. the cache could not grow: fail only these
                self._abort([c.request for c in chunks], error)
                chunks = []
        ended = sum(c.last for c in chunks)
        if not first and not chunks:
            return
        if self._row_params is None or ended:
            rows = self._rows
            self._row_params = RowParams([s.request.params for s in rows], self._device,
                                         seeds=[s.seed for s in rows], counters=[len(s.tokens) for s in rows])
        if not chunks and self._static is not None and self._static.failed is None and \
                self._prefilling.partial is None and static_eligible(self._rows):
            self._sampled(*self._static.step(self._rows, self._row_params), decoded=True)
            return
        step = None
        if first:
            positions = [s.position for s in self._rows[:first]]
            tokens = torch.tensor([s.tokens[-1] for s in self._rows[:first]], dtype=torch.long, device=self._device)
            step = (tokens, torch.tensor(positions, device=self._device), max(positions) + 1)
        groups = chunk_groups(chunks, first)
        prefill = ([c.tokens for c in chunks], groups, [c.start for c in chunks]) if chunks else None
        try:
            self._prefilling.restore(self._runner, chunks, groups)
            logits = self._runner.forward(step, prefill)
        except Exception as error:
            if not chunks:
                raise
            self._abort([c.request for c in chunks], error)  # their rows go; the running rows step again alone
            self._row_params = None
            return
        if chunks:
            self._prefilling.advance(self._runner, chunks, groups)
            source = torch.tensor([i for i, group in enumerate(groups[:ended]) for _ in group], dtype=torch.long,
                                  device=self._device)
            logits = torch.cat([logits[:first], logits[first:first + ended].index_select(0, source)])
            with self._lock:
                self._counters["prefills"] += 1
                self._counters["prompt_tokens"] += sum(c.end - c.start for c in chunks)
                self._counters["peak_running_sequences"] = max(self._counters["peak_running_sequences"],
                                                               len(self._rows))
        if not self._rows:
            return  # only a prompt's first chunks ran: nothing to sample yet
        params = self._row_params
        seen = self._seen[:len(self._rows)] if params.penalty is not None else None
        self._sampled(logits, next_tokens(constrained_logits(logits, self._rows), params, seen), step is not None)

    def _sampled(self, logits: torch.Tensor, new: torch.Tensor, decoded: bool) -> None:
        """After a step's draw: logprobs, the step counted when it decoded running rows, the tokens accepted."""
        record_logprobs(logits, new, self._rows, self._table, self.eos_token_ids)
        if decoded:
            with self._lock:
                self._counters["steps"] += 1
            if self._on_step is not None:
                self._on_step(len(self._rows))
        self._accept(0, new)

    def _open(self, chunks: list[Chunk]) -> None:
        """Rows for the requests whose prompts end in `chunks` (prompts marked as seen), the cache grown to fit all."""
        start = len(self._rows)
        for chunk in chunks:
            if chunk.last:
                self._rows.extend(chunk.request.open(self._pieces))
        extra = 0 if chunks[-1].last else chunks[-1].request.params.n  # a part-way prompt's rows, after the batch's
        requests = [s.request for s in self._rows] + [c.request for c in chunks]
        self._runner.reserve(len(self._rows) + extra, max(len(r.prompt) + r.params.max_new_tokens for r in requests))
        for row, sequence in enumerate(self._rows[start:], start=start):
            if sequence.request.params.repetition_penalty != 1.0:
                self._seen[row].zero_()
                self._seen[row, torch.tensor(sequence.request.prompt, device=self._device)] = True

    def _accept(self, first: int, tokens: torch.Tensor) -> None:
        """Append sampled tokens to rows first.., stream their text, finish and remove what is done."""
        rows = torch.arange(first, first + tokens.shape[0], device=self._device)
        self._seen[rows, tokens] = True
        ids = tokens.tolist()  # the one device->host sync of a step
        for sequence, token in zip(self._rows[first:], ids, strict=True):
            delta = sequence.accept(token, self.eos_token_ids)
            if delta and sequence.request.on_token is not None and not sequence.request.done:
                self._emit(sequence.request, sequence.index, delta, sequence.take_unsent())
        with self._lock:
            self._counters["generated_tokens"] += len(ids)
        self._sweep()

    def _sweep(self) -> None:
        """Remove finished rows (moving the last row into each hole) and resolve completed requests."""
        doomed = [row for row, s in enumerate(self._rows) if s.finish_reason is not None or s.request.done]
        if not doomed:
            return
        finished: dict[int, Request] = {}
        with self._lock:
            for row in reversed(doomed):
                sequence = self._rows[row]
                last = len(self._rows) - 1
                if row != last:
                    moved = self._rows[last]
                    self._runner.move_row(last, row, moved.position)
                    self._seen[row] = self._seen[last]
                    self._rows[row] = moved
                self._rows.pop()
                self._tokens_in_flight -= len(sequence.request.prompt) + sequence.request.params.max_new_tokens
                finished[id(sequence.request)] = sequence.request
            self._prefilling.follow(self._runner, len(self._rows))
        self._row_params = None
        for request in finished.values():
            if not request.done and all(s.finish_reason is not None for s in request.sequences):
                self._complete(request)

    def _reset(self, error: BaseException) -> None:
        """After a failed forward the cache is suspect: fail every running request and start clean."""
        prefilling = list(self._prefilling.requests)
        self._prefilling.remove(prefilling)
        for request in [*(s.request for s in self._rows), *prefilling]:
            self._fail(request, error)
        with self._lock:
            for sequence in self._rows:
                self._tokens_in_flight -= len(sequence.request.prompt) + sequence.request.params.max_new_tokens
            self._tokens_in_flight -= sum(request.cost for request in prefilling)
            self._rows.clear()
        self._row_params = None
        self._runner.release()
