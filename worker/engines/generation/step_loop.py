"""The generation engine's step loop, on the one scheduler thread that computes with the model. Each turn:

    gone, left = cancellations        the cancel hook and is_cancelled polls; cancelled running rows leave
    scheduler.rebalance(...)          rows of tenants above their share pause while others wait; paused rows resume
    plan = scheduler.schedule(...)    what starts and is dropped, the rows to decode, drafts, prompt chunks
    outcome = run the plan            rows open for prompts that end; one forward; the draw; tokens taken, streamed
    scheduler.update(plan, outcome)   prompts that ended hand their blocks on; finished rows give their share back
    finish                            finished rows leave the batch; requests whose every choice finished resolve

The plan and the outcome are plain data (step.py); the loop never reaches into the scheduler's state, nor the
scheduler into the loop's: the batch's rows (running.py), the runner with its KV cache (runners/), the sampling
(sampling/). A cancelled request (is_cancelled polled before every step, or named by the cancelled_ids hook once per
step) ends with finish_reason "cancelled" and the text so far; how requests end is endings.py's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from worker.engines.generation import speculative
from worker.engines.generation.endings import Endings
from worker.engines.generation.lora_manager import LoraManager
from worker.engines.generation.prefill import Chunk
from worker.engines.generation.requests import EngineClosed, SequenceState
from worker.engines.generation.row_outputs import constrained_logits, record_logprobs, record_prompt_logprobs
from worker.engines.generation.runners.cuda_graphs import static_decoder, static_eligible
from worker.engines.generation.runners.runner import DecodeInput, PrefillInput, Runner
from worker.engines.generation.running import RunningRows
from worker.engines.generation.sampling.detokenize import logprob_table, piece_decoders
from worker.engines.generation.sampling.sampler import next_tokens
from worker.engines.generation.scheduler import Scheduler
from worker.engines.generation.step import StepOutcome, StepPlan

Kept = tuple[tuple[int, ...], ...]  # per row, the tokens a step kept (StepOutcome.kept)


class StepLoop:
    """Runs the scheduler's plans on the runner until stopped; owns the batch's rows and the runner's inputs.

    Shares the engine's lock with the client: the scheduler's queue, the rows and the counters are read and written
    under it. cancelled_ids: given the ids of all waiting and running requests, those to drop (one call per turn;
    raising fails the batch). on_step: told the rows of every decode step (the worker's metrics).
    """

    def __init__(self, runner: Runner, scheduler: Scheduler, endings: Endings, lock: threading.RLock, *,
                 tokenizer: PreTrainedTokenizerBase, device: torch.device, lora: LoraManager | None, decode_graphs: str,
                 cancelled_ids: Callable[[list[str]], Collection[str]] | None = None,
                 on_step: Callable[[int], None] | None = None) -> None:
        self.runner, self.cache, self.scheduler, self.endings = runner, runner.cache, scheduler, endings
        self.lora, self.device = lora, device
        self.cancelled_ids, self.on_step = cancelled_ids, on_step
        self.eos_token_ids = runner.eos_token_ids
        vocab_size = runner.config.vocab_size
        self.pieces = piece_decoders(tokenizer, vocab_size)
        self.table = logprob_table(tokenizer, vocab_size)  # each token's bytes, for logprobs
        self.rows = RunningRows(scheduler.max_batch_size, vocab_size, device)
        # decode_graphs "cuda": plain decode steps replay CUDA graphs on a GPU (cuda_graphs.py); "eager": uncaptured
        self.static = static_decoder(decode_graphs, runner, self.rows.seen)
        self._lock = lock
        self._wake = threading.Condition(lock)
        self._stopping = False
        scheduler.bind(runner.cache, runner.max_length)

    # -- the client's side (under the lock) --

    def wake(self) -> None:
        """A request was queued (the caller holds the lock)."""
        self._wake.notify()

    def stop(self) -> None:
        """End the loop after its current step; what waits or runs then fails with EngineClosed."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()

    def occupancy(self) -> dict[str, int]:
        """The batch and the cache, for the engine's stats() (the caller holds the lock)."""
        rows, cache = self.rows.rows, self.cache
        return {"running": len({id(s.request) for s in rows}), "running_sequences": len(rows),
                "cache_blocks": cache.blocks, "cache_blocks_used": cache.used_blocks,
                "cache_block_bytes": cache.block_bytes}

    # -- the loop --

    def run(self) -> None:
        """Step until stopped; a failed step fails its batch, not the engine."""
        with torch.inference_mode():
            while self._wait_for_work():
                try:
                    self.step()
                except Exception as error:  # noqa: BLE001 - a failed forward fails its batch, not the engine
                    self._reset(error)
        self._shutdown()

    def step(self) -> None:
        """One turn: the plan, the runner, the outcome back, the finished rows out."""
        gone, left = self._cancellations()
        if self.lora is not None:
            self.lora.release_finished(self.rows.requests())
        with self._lock:
            pause, resume = self.scheduler.rebalance(self.rows.rows, left=left)
            self.rows.pause(pause, self.cache)
            self.rows.resume(resume, self.cache)
            plan = self.scheduler.schedule(self.rows.rows, gone=gone, now=time.monotonic(), adapters=self.lora)
        self._settle(plan, left)
        if not plan.runs:
            return
        outcome = self._run(plan)
        with self._lock:
            self.scheduler.update(plan, outcome)
        self._resolve(self._leave())

    def _wait_for_work(self) -> bool:
        with self._lock:
            while not self._stopping and not self.rows and not self.scheduler.busy:
                self.scheduler.idle()  # idle: give the cache's memory back
                self._wake.wait()
            return not self._stopping

    def _cancellations(self) -> tuple[set[int], list[SequenceState]]:
        """Requests whose callers went away: the queued ones (their id()s, for the scheduler to drop) and the rows of
        running ones, which finish as "cancelled" with the text so far and leave the batch now (returned)."""
        with self._lock:
            running = list(self.rows.requests().values())  # paused rows' requests too
            ids = list(dict.fromkeys([r.request_id for r in self.scheduler.queued]
                                     + [r.request_id for r in running]))
        flagged = frozenset(self.cancelled_ids(ids)) if self.cancelled_ids is not None and ids else frozenset()
        with self._lock:
            queued = self.scheduler.queued
        # is_cancelled is caller code: polled without holding the lock.
        gone = {id(r) for r in queued if r.future.cancelled() or (
            (r.is_cancelled is not None or r.request_id in flagged) and self.endings.cancelled(r, flagged))}
        hit = False
        for request in running:
            if request.is_cancelled is None and request.request_id not in flagged:
                continue
            if request.done or not self.endings.cancelled(request, flagged):
                continue
            hit = True
            if request.done:  # is_cancelled raised: the request has already failed
                continue
            for index, delta in request.cancel():
                if request.on_token is not None:
                    self.endings.emit(request, index, delta)
            self.endings.count(cancelled=1)
        return gone, self._leave() if hit else []

    def _settle(self, plan: StepPlan, left: list[SequenceState]) -> None:
        """The requests the plan dropped end, as do the running ones cancelled this turn (their rows have left)."""
        self.endings.dropped(plan.expired, plan.cancelled, plan.failed)
        if plan.admitted:
            self.endings.count(cached_prompt_tokens=sum(r.cached_tokens for r in plan.admitted))
        self._resolve(left)

    # -- the plan on the runner --

    def _run(self, plan: StepPlan) -> StepOutcome:
        """Rows open for the prompts that end in the plan; one forward for the batch's rows (with their drafts) and
        the prompt chunks; the draw; each row's tokens taken and streamed. A prompt chunk that fails fails only its
        requests: the batch's rows step again alone next turn."""
        started = time.perf_counter()
        chunks = plan.prefill
        if chunks:
            try:
                self.rows.open(chunks, self.pieces)
            except Exception as error:  # noqa: BLE001 - fail only these
                self._abort(chunks, error)
                chunks = ()
        if not plan.decode and not chunks:
            return StepOutcome(time.perf_counter() - started)
        rows, first = self.rows.rows, len(plan.decode)
        decode = speculative.check_input(plan.decode, plan.drafts, self.device) if plan.drafts else None
        if self.lora is not None:  # each decode token's adapter (a row's drafts too), and each prompt chunk's
            decoding = plan.decode if decode is None or decode.rows is None else [rows[row] for row in decode.rows]
            self.lora.set_rows([s.request for s in decoding], [c.request for c in chunks])
        params = self.rows.params()
        if decode is None and not chunks and self.static is not None and self.static.failed is None and \
                not plan.part_way and static_eligible(rows):
            kept = self._sampled(*self.static.step(rows, params), decoded=True)
            return StepOutcome(time.perf_counter() - started, decoded=first, kept=kept, finished=self._finished())
        if first and decode is None:
            positions = [s.position for s in plan.decode]
            tokens = torch.tensor([s.tokens[-1] for s in plan.decode], dtype=torch.long, device=self.device)
            decode = DecodeInput(tokens, torch.tensor(positions, device=self.device), max(positions) + 1)
        scored = tuple(i for i, c in enumerate(chunks) if c.request.params.prompt_logprobs is not None)
        prefill = PrefillInput([c.tokens for c in chunks], [list(c.rows) for c in chunks], [c.start for c in chunks],
                               scored) if chunks else None
        try:
            logits = self.runner.forward(decode, prefill)
        except Exception as error:
            if not chunks:
                raise
            self._abort(chunks, error)  # their rows go; the running rows step again alone
            return StepOutcome(time.perf_counter() - started)
        if chunks:
            if scored:  # the scored chunks' every position, after the decode rows and each chunk's last position
                end = (0 if decode is None else decode.tokens.shape[0]) + len(chunks)
                record_prompt_logprobs(logits[end:], chunks, self.table)
                logits = logits[:end]
            logits = self._prompt_logits(logits, decode, chunks, len(rows))
        if not rows:  # only a prompt's first chunks ran: nothing to sample yet
            return StepOutcome(time.perf_counter() - started, prefilled=chunks)
        if plan.drafts:
            kept = self._keep_drafts(rows, plan, logits)
        else:
            seen = self.rows.seen[:len(rows)] if params.penalty is not None else None
            masked = constrained_logits(logits, rows, self.eos_token_ids)
            kept = self._sampled(logits, next_tokens(masked, params, seen), first > 0)
        return StepOutcome(time.perf_counter() - started, decoded=first, drafted=plan.draft_positions,
                           prefilled=chunks, kept=kept, finished=self._finished())

    def _prompt_logits(self, logits: torch.Tensor, decode: DecodeInput | None, chunks: Sequence[Chunk],
                       rows: int) -> torch.Tensor:
        """The decode tokens' logits, then one per row opened by an ended prompt (its choices share its last
        position's); the step's prefill counted."""
        decoded = 0 if decode is None else decode.tokens.shape[0]
        ended = sum(c.last for c in chunks)
        source = torch.tensor([i for i, chunk in enumerate(chunks[:ended]) for _ in chunk.rows], dtype=torch.long,
                              device=self.device)
        self.endings.count(prefills=1, prompt_tokens=sum(c.end - c.start for c in chunks))
        self.endings.peak(rows)
        return torch.cat([logits[:decoded], logits[decoded:decoded + ended].index_select(0, source)])

    def _sampled(self, logits: torch.Tensor, new: torch.Tensor, decoded: bool) -> Kept:
        """After a step's draw: logprobs, the step counted when it decoded running rows, the tokens taken."""
        rows = self.rows.rows
        record_logprobs(logits, new, rows, self.table, self.eos_token_ids)
        if decoded:
            self.endings.count(steps=1)
            if self.on_step is not None:
                self.on_step(len(rows))
        self.rows.mark_seen(0, new)
        ids = new.tolist()  # the one device->host sync of a step
        for sequence, token in zip(rows, ids, strict=True):
            self._take(sequence, token)
        self.endings.count(generated_tokens=len(ids))
        return tuple((token,) for token in ids)

    def _keep_drafts(self, rows: list[SequenceState], plan: StepPlan, logits: torch.Tensor) -> Kept:
        """After a speculative step: each decode row keeps its draft while it equals the model's choice, then the
        model's own token; each row opened this step takes its first token (logits: the decode tokens' rows, then
        one per opened row)."""
        spans = [1 + len(draft) for draft in plan.drafts] + [1] * (len(rows) - len(plan.drafts))
        choices = speculative.choices(logits, rows, spans)  # the token plain decoding would take at each position
        kept: list[tuple[int, ...]] = []
        taken = offset = 0
        for index, (sequence, span) in enumerate(zip(rows, spans, strict=True)):
            drafted = list(plan.drafts[index]) if index < len(plan.drafts) else []
            kept.append(tuple(speculative.accepted(drafted, choices[offset:offset + span])))
            for token in kept[-1]:
                self._take(sequence, token)
                taken += 1
                if sequence.finish_reason is not None:
                    break
            offset += span
        self.endings.count(steps=1, speculative_steps=1, generated_tokens=taken, draft_tokens=plan.draft_positions,
                           accepted_draft_tokens=taken - len(rows))
        if self.on_step is not None:
            self.on_step(len(rows))
        self.rows.invalidate()
        return tuple(kept)

    def _take(self, sequence: SequenceState, token: int) -> None:
        """Append one token to a row and stream the text it completes (with the logprobs gathered since the last)."""
        delta = sequence.accept(token, self.eos_token_ids)
        if delta and sequence.request.on_token is not None and not sequence.request.done:
            self.endings.emit(sequence.request, sequence.index, delta, sequence.take_unsent())

    def _finished(self) -> tuple[SequenceState, ...]:
        return tuple(self.rows.finished())

    # -- rows leaving, failures, shutdown --

    def _leave(self) -> list[SequenceState]:
        """Finished rows leave the batch (the last row moves into each hole); returns them."""
        with self._lock:
            return self.rows.remove_finished(self.cache)

    def _resolve(self, left: list[SequenceState]) -> None:
        """Requests whose rows left with every choice finished resolve; adapters no running request uses are freed."""
        if not left:
            return
        for request in {id(s.request): s.request for s in left}.values():
            if not request.done and all(s.finish_reason is not None for s in request.sequences):
                self.endings.complete(request)
        if self.lora is not None:
            self.lora.release_finished(self.rows.requests())

    def _abort(self, chunks: Sequence[Chunk], error: Exception) -> None:
        """Prompt chunks that could not run fail their requests; rows they opened leave, as do their cache rows."""
        requests = [c.request for c in chunks]
        for request in requests:
            self.endings.fail(request, error)
        try:
            left = self._leave()
        except Exception:  # noqa: BLE001 - the cache is suspect: the loop's reset fails the batch with `error`
            raise error from None
        with self._lock:
            self.scheduler.abort(requests, left, len(self.rows))
        self._resolve(left)

    def _reset(self, error: BaseException) -> None:
        """After a failed forward the cache is suspect: fail every running and prefilling request and start clean."""
        with self._lock:
            left = self.rows.clear()
            dropped = self.scheduler.reset(left)
        for request in [*(s.request for s in left), *dropped]:
            self.endings.fail(request, error)
        if self.lora is not None:
            self.lora.release_finished(self.rows.requests())

    def _shutdown(self) -> None:
        with self._lock:
            queued = self.scheduler.drain()
        self.endings.close([*queued, *self.rows.requests().values()],
                           EngineClosed("the generation engine was closed"))
        self.rows.clear()
