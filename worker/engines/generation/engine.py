"""Serve a decoder LM (GPT-2, Llama, Mistral, Qwen2/3): continuous batching over a shared KV cache, one scheduler
thread. Threads call `submit`; the scheduler thread owns the model. Each loop the scheduler (scheduler.py) admits
waiting requests, tenants in turn, while the batch has room; their prompts go into free cache rows in chunks
(prefill.py) beside one decode step for all running sequences; a finished sequence leaves at once and its row is
reused. A cancelled request (is_cancelled() polled before every step, or named by the cancelled_ids hook once per
step) resolves with finish_reason "cancelled" and the text so far; a deadline only applies while a request waits
(DeadlineExceeded). Per-request sampling (sampling/), grammars (sampling/grammar.py), LoRA adapters of the base in
the same batches (lora/manager.py), one runner per architecture (runners/) holding the KV cache (caches/).
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

from core.protocol import SamplingParams, TokenLogprob
from worker.engines.device import DevicePlan, resolve_device
from worker.engines.generation import speculative
from worker.engines.generation.lora.manager import LoraManager
from worker.engines.generation.prefill import Chunk, chunk_groups
from worker.engines.generation.requests import (
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
from worker.engines.generation.runners.cuda_graphs import static_decoder, static_eligible
from worker.engines.generation.runners.decoder import DecoderRunner, open_runner
from worker.engines.generation.runners.runner import DecodeInput, Runner
from worker.engines.generation.running import RunningRows
from worker.engines.generation.sampling.detokenize import logprob_table, piece_decoders
from worker.engines.generation.sampling.grammar import Grammars
from worker.engines.generation.sampling.row_outputs import constrained_logits, record_logprobs
from worker.engines.generation.sampling.sampler import next_tokens
from worker.engines.generation.scheduler import Admission, Scheduler
from worker.engines.generation.tokenizer import chat_ids, load_tokenizer

__all__ = ["DeadlineExceeded", "EngineClosed", "GenerationEngine", "GenerationResult", "QueueFull", "SamplingParams"]


class GenerationEngine:
    """A decoder LM loaded once, decoding many requests together; submit() is thread-safe.

    on_token(choice_index, text_delta) runs on the scheduler thread (keep it short); the deltas of a
    choice concatenate to its final text. A callback that raises fails its own request only.
    Composed of: a runner for the architecture (with its KV cache), the scheduler (queues, admission, prefill
    budget), the running rows, grammars, and, over a llama-family base, the LoRA manager.
    """

    def __init__(
        self, model: str | Path, *, device: str = "auto", precision: str = "auto", max_batch_size: int = 32,
        max_tokens_in_flight: int = 16384, max_queue: int = 256, tenant_queue_share: float = 1.0,
        cancelled_ids: Callable[[list[str]], Collection[str]] | None = None,
        on_step: Callable[[int], None] | None = None, prefill_chunk_tokens: int = 2048, prefill_step_ratio: float = 1.5,
        prefix_cache_bytes: int = 0, decode_graphs: str = "off", max_loras: int = 8,
        adapter_folder: Callable[[str], Path] | None = None, speculative_tokens: int = 0,
        speculative_max_rows: int = 32,
    ) -> None:
        for name, value in (("speculative_tokens", speculative_tokens), ("speculative_max_rows", speculative_max_rows)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be 0 (off) or a positive integer, got {value!r}")
        self.scheduler = Scheduler(max_batch_size=max_batch_size, max_tokens_in_flight=max_tokens_in_flight,
                                   max_queue=max_queue, tenant_queue_share=tenant_queue_share,
                                   prefill_chunk_tokens=prefill_chunk_tokens, prefill_step_ratio=prefill_step_ratio,
                                   prefix_cache_bytes=prefix_cache_bytes)
        self.max_batch_size = max_batch_size
        self.prefix_cache_bytes = prefix_cache_bytes
        self.max_tokens_in_flight = max_tokens_in_flight
        self.max_queue = max_queue
        self.max_loras = max_loras
        # Given the ids of all waiting and running requests, those to drop: one call per loop (raising fails the batch).
        self._cancelled_ids = cancelled_ids
        # Told the batch size of every decode step (the worker's metrics); runs on the scheduler thread.
        self._on_step = on_step
        self._encode_lock = threading.Lock()  # HF fast tokenizers are not safe to call from many threads
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._counters = {"steps": 0, "prefills": 0, "prompt_tokens": 0, "generated_tokens": 0,
                          "completed": 0, "cancelled": 0, "expired": 0, "failed": 0, "peak_running_sequences": 0,
                          "speculative_steps": 0, "draft_tokens": 0, "accepted_draft_tokens": 0,
                          "cached_prompt_tokens": 0}
        # Speculative decoding (speculative.py): up to this many prompt-lookup draft tokens per row, as many as pay
        # by the measured step costs, while at most speculative_max_rows rows decode; 0: off.
        self.speculative_tokens, self.speculative_max_rows = speculative_tokens, speculative_max_rows
        self._step_costs = speculative.StepCosts()
        self._draft_rates = speculative.DraftRates()
        # The model loads on the scheduler thread, the one thread that computes with it. On a CPU every thread that
        # runs an OpenMP parallel region keeps a team of worker threads; once a process holds more of them than it
        # has cores, GNU OpenMP's workers stop spinning between regions and sleep, and each of a decode step's
        # hundreds of small regions pays a wake-up (a 16-row step measured 1.3-1.7x slower with the model loaded on
        # the caller's thread and stepped on this one).
        loaded: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, args=(loaded, model, device, precision, decode_graphs,
                                                                 adapter_folder),
                                        name="generation-scheduler", daemon=True)
        self._thread.start()
        loaded.result()  # a load error (a missing folder, an unsupported architecture) raises here

    def _load(self, model: str | Path, device: str, precision: str, decode_graphs: str,
              adapter_folder: Callable[[str], Path] | None) -> None:
        """The runner (weights and KV cache), tokenizer, grammars and rows: on the scheduler thread (see __init__)."""
        self.plan: DevicePlan = resolve_device(device, precision, generation=True)
        self._runner: Runner = open_runner(model, self.plan, max_rows=self.max_batch_size)  # GPT-2 or llama-family
        self.tokenizer = load_tokenizer(model)
        self.config = self._runner.config
        self.context_length: int = self._runner.max_length
        self.vocab_size: int = self.config.vocab_size
        self.eos_token_ids = self._runner.eos_token_ids  # generation_config.json's (one id or a list)
        # GPT-2 has no adapter path here: its adapter requests are refused (serve the merged model instead).
        self.lora: LoraManager | None = None
        if isinstance(self._runner, DecoderRunner):
            self.lora = LoraManager(self._runner, max_loras=self.max_loras, adapter_folder=adapter_folder or Path)
        self._pieces = piece_decoders(self.tokenizer, self.vocab_size)
        self._table = logprob_table(self.tokenizer, self.vocab_size)  # each token's bytes, for logprobs
        self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._device = torch.device(self.plan.device)
        self._running = RunningRows(self.max_batch_size, self.vocab_size, self._device)  # the scheduler thread's
        # decode_graphs "cuda": plain decode steps replay CUDA graphs on a GPU (cuda_graphs.py); "eager": uncaptured
        self._static = static_decoder(decode_graphs, self._runner, self._running.seen)

    # -- the callers' side --

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a prompt with the tokenizer's own special tokens (Llama's BOS; none for GPT-2), as vLLM does."""
        with self._encode_lock:
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    **template_kwargs: Any) -> list[int]:
        """Prompt ids of a chat through the model's own chat template (NoChatTemplate when it has none)."""
        with self._encode_lock:
            return chat_ids(self.tokenizer, messages, tools, **template_kwargs)

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
                self._counters["expired"] += 1
                request.future.set_exception(DeadlineExceeded(f"request {request.request_id}: deadline already passed"))
                return request.future
            self.scheduler.add(request)
            self._wake.notify()
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
            rows = list(self._running.rows)
            cache = self._runner.cache
            return {"running": len({id(s.request) for s in rows}), "running_sequences": len(rows),
                    **self.scheduler.stats(),
                    "max_batch_size": self.max_batch_size, "max_tokens_in_flight": self.max_tokens_in_flight,
                    "cache_blocks": cache.blocks, "cache_blocks_used": cache.used_blocks,
                    "prefix_cache_blocks": self.scheduler.prefilling.cached_blocks,
                    "cache_block_bytes": cache.block_bytes, "closed": self._closed,
                    "adapters": self.lora.resident() if self.lora is not None else [], "max_loras": self.max_loras,
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

    # -- the scheduler thread --

    def _run(self, loaded: Future[None], model: str | Path, device: str, precision: str, decode_graphs: str,
             adapter_folder: Callable[[str], Path] | None) -> None:
        try:
            self._load(model, device, precision, decode_graphs, adapter_folder)
        except BaseException as error:  # noqa: BLE001 - handed to the constructor, which raises it
            loaded.set_exception(error)
            return
        loaded.set_result(None)
        with torch.inference_mode():
            while self._wait_for_work():
                try:
                    flagged = self._flagged()
                    self._start(self._admit(flagged))
                    self._poll_cancelled(flagged)
                    decoding = bool(self._running)
                    with self._lock:
                        chunks = self.scheduler.chunks(decoding)
                    if decoding or chunks:
                        started, rows = time.perf_counter(), len(self._running)
                        drafts = self._step(chunks)
                        elapsed = time.perf_counter() - started
                        if decoding and not chunks:
                            self._step_costs.observe(rows + drafts, elapsed)
                        with self._lock:  # a speculative step's draft positions cost as prompt tokens do
                            self.scheduler.observe(elapsed, decoding, chunks, drafts)
                except Exception as error:  # noqa: BLE001 - a failed forward fails its batch, not the engine
                    self._reset(error)
        self._shutdown()

    def _wait_for_work(self) -> bool:
        with self._lock:
            while not self._closed and not self.scheduler.waiting and not self._running \
                    and not self.scheduler.prefilling.requests:
                self.scheduler.prefilling.idle(self._runner.cache)  # idle: give the cache's memory back
                self._wake.wait()
            return not self._closed

    def _flagged(self) -> frozenset[str]:
        """Ids the cancelled_ids hook names among waiting and running requests (one call for all of them)."""
        with self._lock:
            ids = list(dict.fromkeys([r.request_id for r in [*self.scheduler.waiting,
                                                             *self.scheduler.prefilling.requests]]
                                     + [q.request.request_id for q in self._running.rows]))
        return frozenset(self._cancelled_ids(ids)) if self._cancelled_ids is not None and ids else frozenset()

    def _admit(self, flagged: frozenset[str] = frozenset()) -> list[Request]:
        """The scheduler's admissions; waiting requests that expired, were cancelled or failed resolve here."""
        if self.lora is not None:
            self.lora.release_finished(self._running.requests())
        with self._lock:
            watched = [r for r in self.scheduler.waiting
                       if r.is_cancelled is not None or r.future.cancelled() or r.request_id in flagged]
        # is_cancelled is caller code: polled without holding the lock.
        gone = {id(r) for r in watched if r.future.cancelled() or self._cancelled(r, flagged)}
        with self._lock:
            admission: Admission = self.scheduler.admit(gone, time.monotonic(), self.lora)
            self._counters["expired"] += len(admission.expired)
            self._counters["cancelled"] += len(admission.cancelled)
        for request in admission.expired:
            request.future.set_exception(DeadlineExceeded(f"request {request.request_id} waited past its deadline"))
        for request in admission.cancelled:
            if not request.future.cancelled() and not request.done:
                request.done = True
                request.future.set_result(request.result())
        for request, error in admission.failed:
            self._fail(request, error)
        return admission.admitted

    def _start(self, admitted: list[Request]) -> None:
        """Queue admitted requests for prefill (those cancelled meanwhile give their rows back)."""
        for request in admitted:
            with self._lock:
                if request.future.set_running_or_notify_cancel():
                    self.scheduler.prefilling.add(self._runner.cache, request)
                    self._counters["cached_prompt_tokens"] += request.cached_tokens
                else:
                    self.scheduler.release(request, request.params.n)

    def _abort(self, requests: list[Request], error: BaseException) -> None:
        with self._lock:
            self.scheduler.prefilling.remove(self._runner.cache, requests)
        for request in requests:
            self._fail(request, error)
            if not request.sequences:
                with self._lock:
                    self.scheduler.release(request, request.params.n)
        try:
            self._sweep()
        except Exception:  # noqa: BLE001
            self._reset(error)
            return
        with self._lock:  # rows the failed requests' prefills took beyond the batch (and a part-way prompt's)
            partial = self.scheduler.prefilling.partial
            kept = self.scheduler.prefilling.tail + partial.params.n if partial is not None else len(self._running)
            self._runner.cache.free_rows_from(kept)

    def _step(self, chunks: list[Chunk]) -> int:
        """One decode step for every running row with the prefill of `chunks` (one pass); ended prompts sample.
        Returns the draft tokens the step checked (0 unless it speculated)."""
        first = len(self._running)
        if chunks:
            try:
                self._open(chunks)
            except Exception as error:  # noqa: BLE001 - e.g. the cache could not grow: fail only these
                self._abort([c.request for c in chunks], error)
                chunks = []
        ended = sum(c.last for c in chunks)
        if not first and not chunks:
            return 0
        rows = self._running.rows
        plan = self._drafts(rows, first, chunks)
        if self.lora is not None:  # each decode token's adapter (a row's drafts too), and each prompt chunk's
            decoding = rows[:first] if plan is None or plan.step.rows is None else [rows[row] for row in plan.step.rows]
            self.lora.set_rows([s.request for s in decoding], [c.request for c in chunks])
        prefilling = self.scheduler.prefilling
        params = self._running.params()
        if plan is None and not chunks and self._static is not None and self._static.failed is None and \
                prefilling.partial is None and static_eligible(rows):
            self._sampled(*self._static.step(rows, params), decoded=True)
            return 0
        step = plan.step if plan is not None else None
        if first and step is None:
            positions = [s.position for s in rows[:first]]
            tokens = torch.tensor([s.tokens[-1] for s in rows[:first]], dtype=torch.long, device=self._device)
            step = DecodeInput(tokens, torch.tensor(positions, device=self._device), max(positions) + 1)
        groups = chunk_groups(chunks, first)
        prefill = ([c.tokens for c in chunks], groups, [c.start for c in chunks]) if chunks else None
        try:
            prefilling.restore(self._runner.cache, chunks, groups)
            logits = self._runner.forward(step, prefill)
        except Exception as error:
            if not chunks:
                raise
            self._abort([c.request for c in chunks], error)  # their rows go; the running rows step again alone
            return 0
        if chunks:
            with self._lock:
                prefilling.advance(self._runner.cache, chunks, groups)
            decoded = 0 if step is None else step.tokens.shape[0]
            source = torch.tensor([i for i, group in enumerate(groups[:ended]) for _ in group], dtype=torch.long,
                                  device=self._device)
            logits = torch.cat([logits[:decoded], logits[decoded:decoded + ended].index_select(0, source)])
            with self._lock:
                self._counters["prefills"] += 1
                self._counters["prompt_tokens"] += sum(c.end - c.start for c in chunks)
                self._counters["peak_running_sequences"] = max(self._counters["peak_running_sequences"], len(rows))
        if not rows:
            return 0  # only a prompt's first chunks ran: nothing to sample yet
        if plan is not None:
            self._keep_drafts(rows, plan, logits)
            return plan.positions
        seen = self._running.seen[:len(rows)] if params.penalty is not None else None
        self._sampled(logits, next_tokens(constrained_logits(logits, rows), params, seen), step is not None)
        return 0

    def _drafts(self, rows: list[SequenceState], first: int, chunks: list[Chunk]) -> speculative.Plan | None:
        """The step's speculative decode tokens (speculative.py), or None when this step does not speculate: rows
        0..first-1 decode, the rest just opened for prompts that end in `chunks` (they take their first token)."""
        if not self.speculative_tokens or not first or len(rows) > self.speculative_max_rows or \
                not all(speculative.eligible(s) for s in rows):
            return None
        decoding = rows[:first]
        proposals = [speculative.draft(s, self.speculative_tokens, self.context_length) for s in decoding]
        # Measured step times price each checked position against what the decode rows yield alone (a step's prompt
        # tokens do not lower the bar: their time buys the prefill, not decode tokens).
        decode_s, position_s = self._step_costs.price(first)
        taken = speculative.lengths([self._draft_rates.yields(s, p) for s, p in zip(decoding, proposals, strict=True)],
                                    decode_s, position_s)
        if not any(taken):
            return None
        return speculative.Plan.build(decoding, proposals, taken, self._device)

    def _keep_drafts(self, rows: list[SequenceState], plan: speculative.Plan, logits: torch.Tensor) -> None:
        """After a speculative step: each decode row keeps its draft while it equals the model's choice, then the
        model's own token; each row opened this step takes its first token (logits: the decode tokens' rows, then
        one per opened row)."""
        spans = [len(chunk) for chunk in plan.chunks] + [1] * (len(rows) - len(plan.chunks))
        choices = speculative.choices(logits, rows, spans)  # the token plain decoding would take at each position
        kept = offset = 0
        for index, (sequence, span) in enumerate(zip(rows, spans, strict=True)):
            drafted = plan.drafts[index] if index < len(plan.drafts) else []
            kept_tokens = speculative.accepted(drafted, choices[offset:offset + span])
            if index < len(plan.proposals):
                self._draft_rates.record(sequence, plan.proposals[index], drafted, kept_tokens)
            for token in kept_tokens:
                self._take(sequence, token)
                kept += 1
                if sequence.finish_reason is not None:
                    break
            offset += span
        with self._lock:
            self._counters["steps"] += 1
            self._counters["speculative_steps"] += 1
            self._counters["generated_tokens"] += kept
            self._counters["draft_tokens"] += plan.positions
            self._counters["accepted_draft_tokens"] += kept - len(rows)
        if self._on_step is not None:
            self._on_step(len(rows))
        self._running.invalidate()
        self._sweep()

    def _sampled(self, logits: torch.Tensor, new: torch.Tensor, decoded: bool) -> None:
        """After a step's draw: logprobs, the step counted when it decoded running rows, the tokens accepted."""
        record_logprobs(logits, new, self._running.rows, self._table, self.eos_token_ids)
        if decoded:
            with self._lock:
                self._counters["steps"] += 1
            if self._on_step is not None:
                self._on_step(len(self._running))
        self._accept(new)

    def _open(self, chunks: list[Chunk]) -> None:
        """Rows for the requests whose prompts end in `chunks` (their blocks are taken as their positions fill)."""
        self._running.open(chunks, self._pieces)

    def _accept(self, tokens: torch.Tensor) -> None:
        """Append sampled tokens to the rows, stream their text, finish and remove what is done."""
        self._running.mark_seen(0, tokens)
        ids = tokens.tolist()  # the one device->host sync of a step
        for sequence, token in zip(self._running.rows, ids, strict=True):
            self._take(sequence, token)
        with self._lock:
            self._counters["generated_tokens"] += len(ids)
        self._sweep()

    def _take(self, sequence: SequenceState, token: int) -> None:
        """Append one token to a row and stream the text it completes (with the logprobs gathered since the last)."""
        delta = sequence.accept(token, self.eos_token_ids)
        if delta and sequence.request.on_token is not None and not sequence.request.done:
            self._emit(sequence.request, sequence.index, delta, sequence.take_unsent())

    def _sweep(self) -> None:
        """Remove finished rows (the last row moves into each hole) and resolve completed requests."""
        with self._lock:
            removed = self._running.remove_finished(self._runner.cache)
            if not removed:
                return
            for sequence in removed:
                self.scheduler.release(sequence.request, 1)
            self.scheduler.prefilling.follow(self._runner.cache, len(self._running))
        finished = {id(s.request): s.request for s in removed}
        for request in finished.values():
            if not request.done and all(s.finish_reason is not None for s in request.sequences):
                self._complete(request)
        if self.lora is not None:
            self.lora.release_finished(self._running.requests())

    def _reset(self, error: BaseException) -> None:
        """After a failed forward the cache is suspect: fail every running request and start clean."""
        with self._lock:
            prefilling = list(self.scheduler.prefilling.requests)
            self.scheduler.prefilling.remove(self._runner.cache, prefilling)
        for request in [*(s.request for s in self._running.rows), *prefilling]:
            self._fail(request, error)
        with self._lock:
            for sequence in self._running.clear():
                self.scheduler.release(sequence.request, 1)
            for request in prefilling:
                self.scheduler.release(request, request.params.n)
            self.scheduler.prefilling.clear(self._runner.cache)
        if self.lora is not None:
            self.lora.release_finished(self._running.requests())

    # -- how requests end --

    def _emit(self, request: Request, index: int, delta: str, logprobs: list[TokenLogprob] | None = None) -> None:
        assert request.on_token is not None
        try:
            if request.params.logprobs is not None:  # such a request's callback takes the delta's logprobs too
                request.on_token(index, delta, logprobs or [])
            else:
                request.on_token(index, delta)
        except Exception as error:  # noqa: BLE001 - a broken callback fails its own request only
            self._fail(request, error)

    def _cancelled(self, request: Request, flagged: frozenset[str] = frozenset()) -> bool:
        if request.request_id in flagged:
            return True
        if request.is_cancelled is None:
            return False
        try:
            return bool(request.is_cancelled())
        except Exception as error:  # noqa: BLE001
            self._fail(request, error)
            return True

    def _poll_cancelled(self, flagged: frozenset[str] = frozenset()) -> None:
        # Requests still being prefilled: dropped at once (a long prompt's remaining chunks are not run).
        dropped = [r for r in self.scheduler.prefilling.requests
                   if (r.is_cancelled is not None or r.request_id in flagged) and self._cancelled(r, flagged)]
        with self._lock:
            self.scheduler.prefilling.remove(self._runner.cache, dropped)
        for request in dropped:
            with self._lock:
                self.scheduler.release(request, request.params.n)
                self._counters["cancelled"] += not request.done
            if not request.done:  # (is_cancelled raised: already failed)
                request.done = True
                request.future.set_result(request.result())
        requests = {id(s.request): s.request for s in self._running.rows
                    if s.request.is_cancelled is not None or s.request.request_id in flagged}
        hit = False
        for request in requests.values():
            if request.done or not self._cancelled(request, flagged):
                continue
            hit = True
            if request.done:  # is_cancelled raised: the request has already failed
                continue
            for index, delta in request.cancel():
                if request.on_token is not None:
                    self._emit(request, index, delta)
            with self._lock:
                self._counters["cancelled"] += 1
        if hit:
            self._sweep()

    def _complete(self, request: Request) -> None:
        request.done = True
        with self._lock:
            self._counters["completed"] += 1
        request.future.set_result(request.result())

    def _fail(self, request: Request, error: BaseException) -> None:
        if request.done:
            return
        request.done = True
        with self._lock:
            self._counters["failed"] += 1
        request.future.set_exception(error)

    def _shutdown(self) -> None:
        with self._lock:
            waiting = self.scheduler.drain()
        error = EngineClosed("the generation engine was closed")
        for request in [*waiting, *self.scheduler.prefilling.requests, *(s.request for s in self._running.rows)]:
            if not request.done and not request.future.done():
                request.done = True
                request.future.set_exception(error)
        self._running.clear()
        self.scheduler.prefilling.clear(self._runner.cache)

