"""The generation scheduler: which waiting requests start, and what each step runs.

vLLM's seam, one plan per step: the engine's step loop asks `schedule()` for a StepPlan (step.py: the requests
started and dropped, the batch's rows to decode and their drafts, the prompt chunks to prefill with their cache rows),
runs it on the runner and hands the StepOutcome back to `update()` (the prompts that ended, the rows that finished,
the step's time); neither reaches into the other's state. A step frees before it admits: rows that left the batch
and requests cancelled while queued give their share back first. The scheduler alone owns the waiting queues, the
rows and cache positions in flight (`max_batch_size`, `max_tokens_in_flight`), each tenant's share, the adapter
slots' constraint (through the LoRA manager), the prefill queue with the prefix cache and the chunk budget
(prefill.py), and which rows speculate and how far (speculative.py), sized by the measured step times. Its methods
run under the engine's lock.

Rows count, not requests: a request of n choices takes n rows and n x (prompt + max_new_tokens) cache positions,
in the queue bound as in the batch.

Fair share, as the training scheduler shares devices between tenants' jobs:
- Requests wait in one queue per tenant (None: one tenant). Admission takes the tenants in turn, one request each
  per round, starting after the tenant admitted last, so a tenant's flood waits behind its own requests only.
- Interactive requests go before batch requests (`/v1/batches` lines): a batch request is admitted only when no
  interactive request that fits is waiting.
- While another tenant has requests waiting, a tenant's running rows stay within its share of the batch,
  max_batch_size / active tenants (a tenant holding no row may always start one request), so freed rows go to the
  tenant that waits, however large its next request; rows nobody else asks for are not held back.
- Running rows are shared too (`rebalance()`, before each step's plan): when a tenant below its share waits for rows
  the batch lacks, tenants above their share pause their newest rows, never below their share. A paused row leaves
  the batch with its keys and values kept in the cache (its cache positions stay counted) and resumes, unchanged,
  into a free row within its tenant's share, before that tenant's new requests start. So a newcomer waits about one
  step for a row, not for another tenant's longest generation to end. What is not preempted: cache positions (a
  request whose positions do not fit waits for them) and the rows of prompts still being prefilled.
- An engine that cannot pause a row (vLLM's: its requests run in its own scheduler) gives `spare_rows` instead: a
  tenant within its share may start beyond max_batch_size, up to max_batch_size + spare_rows, while another tenant
  holds more than its share; the engine's batch is that much wider (vLLM's --max-num-seqs), and only such
  newcomers use it.
- The waiting queue holds at most max_queue rows, and one tenant at most max_queue x `tenant_queue_share` of them,
  so a flood of one tenant's requests is refused (QueueFull: 429) while another tenant's are still queued.
Within one tenant's queue the order is first come, first served: a request that does not fit waits at the head
for room rather than being overtaken forever, except by requests whose adapter needs no new slot while an adapter
waits for one (a slot frees only when its requests end).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from worker.engines.generation import speculative
from worker.engines.generation.caches.paged_cache import PagedCache
from worker.engines.generation.caches.prefix_cache import PrefixCache
from worker.engines.generation.lora.adapter_cache import AdapterCacheFull
from worker.engines.generation.prefill import ChunkBudget, PrefillQueue
from worker.engines.generation.requests import QueueFull, Request, SequenceState
from worker.engines.generation.step import StepOutcome, StepPlan


class AdapterSlots(Protocol):
    """What admission needs of the LoRA manager: whether an adapter is resident, and a slot for a request."""

    def __contains__(self, name: object) -> bool: ...

    def acquire(self, request: Request) -> None:
        """Give the request's adapter a slot; AdapterCacheFull when every slot is held by running requests."""
        ...


@dataclass
class Admission:
    """What one admission pass decided: requests to start, and those dropped while they waited."""

    admitted: list[Request] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)  # waited past their deadline
    cancelled: list[Request] = field(default_factory=list)  # their callers went away while they waited
    failed: list[tuple[Request, Exception]] = field(default_factory=list)  # e.g. an adapter that could not load


class Scheduler:
    """The waiting queues, admission under the row, token and share bounds, and the plan of each step."""

    def __init__(self, *, max_batch_size: int, max_tokens_in_flight: int, max_queue: int,
                 tenant_queue_share: float = 1.0, prefill_chunk_tokens: int = 2048,
                 prefill_step_ratio: float = 1.5, prefix_cache_bytes: int = 0, speculative_tokens: int = 0,
                 speculative_max_rows: int = 32, prefix_cache_across_tenants: bool = False,
                 spare_rows: int = 0) -> None:
        for name, value in (("max_batch_size", max_batch_size), ("max_tokens_in_flight", max_tokens_in_flight),
                            ("max_queue", max_queue)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, value in (("prefill_chunk_tokens", prefill_chunk_tokens), ("prefix_cache_bytes", prefix_cache_bytes),
                            ("speculative_tokens", speculative_tokens), ("speculative_max_rows", speculative_max_rows),
                            ("spare_rows", spare_rows)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be 0 (off) or a positive integer, got {value!r}")
        if not isinstance(prefill_step_ratio, int | float) or not (prefill_step_ratio == 0 or prefill_step_ratio > 1):
            raise ValueError(f"prefill_step_ratio must be 0 (fixed chunks) or above 1, got {prefill_step_ratio!r}")
        if not isinstance(tenant_queue_share, int | float) or not 0 < tenant_queue_share <= 1:
            raise ValueError(f"tenant_queue_share must be in (0, 1], got {tenant_queue_share!r}")
        self.max_batch_size = max_batch_size
        self.spare_rows = spare_rows  # rows past max_batch_size for a newcomer while another tenant is over its share
        self.max_tokens_in_flight = max_tokens_in_flight
        self.max_queue = max_queue
        self.max_queue_per_tenant = max(1, math.floor(max_queue * tenant_queue_share))
        # Tenant -> its waiting requests in arrival order; tenants in the order their turn comes.
        self._waiting: OrderedDict[str | None, deque[Request]] = OrderedDict()
        self._waiting_rows: dict[str | None, int] = {}
        self._running_rows: dict[str | None, int] = {}  # admitted and not yet left the batch (prefilling included)
        # Tenant -> its paused rows, first paused first (out of the batch, blocks kept: running.RunningRows.pause).
        self._paused: OrderedDict[str | None, list[SequenceState]] = OrderedDict()
        self.pauses = 0  # rows paused so far
        self.tokens_in_flight = 0
        # Started requests whose prompts are still going into the cache, in chunks sized by the budget.
        # With prefix_cache_bytes, the KV of shared prompt prefixes is reused (caches/prefix_cache.py).
        # A tenant's cached blocks are its own unless prefix_cache_across_tenants.
        self._prefill = PrefillQueue(PrefixCache(prefix_cache_bytes, prefix_cache_across_tenants)
                                     if prefix_cache_bytes else None)
        self.budget = ChunkBudget(prefill_chunk_tokens or None, prefill_step_ratio)
        # Speculative decoding (speculative.py): up to this many prompt-lookup draft tokens per row, as many as pay
        # by the measured step costs, while at most speculative_max_rows rows decode; 0: off.
        self.speculative_tokens, self.speculative_max_rows = speculative_tokens, speculative_max_rows
        self._costs = speculative.StepCosts()
        self._rates = speculative.DraftRates()
        self._cache: PagedCache | None = None
        self._context_length = 0

    def bind(self, cache: PagedCache, context_length: int) -> None:
        """The loaded model's KV cache (prompts and cached prefixes go into it) and its context (drafts stay within
        it): once, before the first step."""
        self._cache, self._context_length = cache, context_length

    @property
    def cache(self) -> PagedCache:
        """The KV cache bound to (RuntimeError before bind())."""
        if self._cache is None:
            raise RuntimeError("the scheduler has no KV cache yet (bind() it to the loaded model's)")
        return self._cache

    # -- the queue (callers' threads, under the engine's lock) --

    def add(self, request: Request) -> None:
        """Queue a request; QueueFull when the queue, or this tenant's part of it, has no room for its rows."""
        rows, tenant = request.params.n, request.tenant
        waiting = sum(self._waiting_rows.values())
        if waiting + rows > self.max_queue:
            raise QueueFull(f"{waiting} rows are already waiting (max_queue={self.max_queue})")
        mine = self._waiting_rows.get(tenant, 0)
        if mine + rows > self.max_queue_per_tenant:
            raise QueueFull(f"this tenant already has {mine} rows waiting (its share of the queue is "
                            f"{self.max_queue_per_tenant} of max_queue={self.max_queue})")
        self._waiting.setdefault(tenant, deque()).append(request)
        self._waiting_rows[tenant] = mine + rows

    @property
    def waiting(self) -> list[Request]:
        """Every waiting request (a snapshot)."""
        return [request for queue in self._waiting.values() for request in queue]

    @property
    def queued(self) -> list[Request]:
        """Every request not in the batch yet: those waiting, then those whose prompts are going in (a snapshot)."""
        return [*self.waiting, *self._prefill.requests]

    @property
    def busy(self) -> bool:
        """Whether a request waits or is being prefilled, or a row is paused."""
        return bool(self._waiting or self._prefill.requests or self._paused)

    # -- admission (the engine's scheduler thread) --

    def admit(self, gone: Collection[int], now: float, adapters: AdapterSlots | None, *, start: bool = True
              ) -> Admission:
        """Drop expired and cancelled (`gone`: their id()s) waiting requests, then (unless `start` is False: the
        engine admits nothing for now) admit what fits, tenants in turn."""
        outcome = Admission()
        for queue in self._waiting.values():
            for request in list(queue):
                if id(request) in gone:
                    outcome.cancelled.append(request)
                elif request.deadline is not None and request.deadline < now:
                    outcome.expired.append(request)
        for request in [*outcome.cancelled, *outcome.expired]:
            self._unqueue(request)
        if not start:
            return outcome
        rows = sum(self._running_rows.values())
        for interactive in (True, False):
            rows = self._admit_class(interactive, rows, adapters, outcome)
        return outcome

    def _admit_class(self, interactive: bool, rows: int, adapters: AdapterSlots | None, outcome: Admission) -> int:
        """Round robin over the tenants' queues, one request of the class per tenant per round, while any fits."""
        blocked: dict[str | None, bool] = {}  # tenants whose earlier request waits for an adapter slot
        stopped: set[str | None] = set()  # tenants whose next request does not fit now
        progress = True
        while progress:
            progress = False
            for tenant in list(self._waiting):
                if tenant in stopped:
                    continue
                request = self._next(tenant, interactive, rows, adapters, blocked, outcome)
                if request is None:
                    stopped.add(tenant)
                    continue
                self._unqueue(request)
                self._running_rows[tenant] = self._running_rows.get(tenant, 0) + request.params.n
                self.tokens_in_flight += request.cost
                rows += request.params.n
                outcome.admitted.append(request)
                if tenant in self._waiting:  # its turn is over: the other tenants' come first next time
                    self._waiting.move_to_end(tenant)
                progress = True
        return rows

    def _next(self, tenant: str | None, interactive: bool, rows: int, adapters: AdapterSlots | None,
              blocked: dict[str | None, bool], outcome: Admission) -> Request | None:
        """The tenant's first waiting request of the class that may start now, its adapter slot taken; None if none
        (also while the tenant has paused rows: they resume first)."""
        if tenant in self._paused:
            return None
        for request in list(self._waiting.get(tenant, ())):
            if request.batch == interactive:
                continue
            n = request.params.n
            if rows + n > self.max_batch_size + self._spare_for(tenant, n) \
                    or self.tokens_in_flight + request.cost > self.max_tokens_in_flight \
                    or not self._within_share(tenant, n, interactive):
                return None  # first come, first served within a tenant: it waits for room at the head
            use = request.adapter
            if use is None or adapters is None:
                return request
            if blocked.get(tenant) and use.name not in adapters:
                continue  # an earlier request waits for a slot: no later one takes one before it
            try:
                adapters.acquire(request)
            except AdapterCacheFull:
                blocked[tenant] = True
                continue
            except Exception as error:  # noqa: BLE001 - e.g. a re-read folder that vanished: fail this request
                self._unqueue(request)
                outcome.failed.append((request, error))
                continue
            return request
        return None

    def _within_share(self, tenant: str | None, rows: int, interactive: bool) -> bool:
        """Whether the tenant may take `rows` more rows: always while no other tenant waits (rows nobody else asks
        for are not held back) or while it holds none; otherwise within max_batch_size / active tenants."""
        others_wait = any(t != tenant and any(r.batch != interactive for r in queue)
                          for t, queue in self._waiting.items()) or any(t != tenant for t in self._paused)
        held = self._running_rows.get(tenant, 0)
        if not others_wait or held == 0:
            return True
        return held + rows <= self._share(tenant)

    def _spare_for(self, tenant: str | None, rows: int) -> int:
        """The spare rows a tenant's next `rows` may use: all of them while it stays within its share and another
        tenant holds more than its own; none otherwise (and none on an engine that pauses rows instead)."""
        if not self.spare_rows:
            return 0
        held = self._running_rows.get(tenant, 0)
        if held and held + rows > self._share(tenant):
            return 0
        over = any(t != tenant and n > self._share(t) for t, n in self._running_rows.items())
        return self.spare_rows if over else 0

    def _share(self, tenant: str | None) -> float:
        """A tenant's share of the batch's rows: max_batch_size over the tenants waiting, running or paused."""
        active = {t for t, queue in self._waiting.items() if queue} | {t for t, n in self._running_rows.items() if n}
        return self.max_batch_size / len(active | set(self._paused) | {tenant})

    def _unqueue(self, request: Request) -> None:
        tenant = request.tenant
        queue = self._waiting[tenant]
        queue.remove(request)
        self._waiting_rows[tenant] -= request.params.n
        if not queue:
            del self._waiting[tenant]
            del self._waiting_rows[tenant]

    def leave(self, sequence: SequenceState) -> None:
        """A row left the batch (finished, cancelled, failed), or a paused one ended: its share goes back."""
        paused = self._paused.get(sequence.request.tenant, [])
        if sequence not in paused:
            self.release(sequence.request, 1)
            return
        paused.remove(sequence)
        if not paused:
            del self._paused[sequence.request.tenant]
        self.tokens_in_flight -= len(sequence.request.prompt) + sequence.request.params.max_new_tokens

    def release(self, request: Request, rows: int) -> None:
        """`rows` of an admitted request left the batch (finished, cancelled or failed): their share goes back."""
        self.tokens_in_flight -= rows * (len(request.prompt) + request.params.max_new_tokens)
        left = self._running_rows.get(request.tenant, 0) - rows
        if left > 0:
            self._running_rows[request.tenant] = left
        else:
            self._running_rows.pop(request.tenant, None)

    # -- running rows shared (the engine's scheduler thread, before each step's plan) --

    def rebalance(self, batch: Sequence[SequenceState], *, left: Sequence[SequenceState] = ()
                  ) -> tuple[list[SequenceState], list[SequenceState]]:
        """Rows that `left` the batch since the last step give their share back; then the rows of `batch` (the
        running rows) to pause and the paused rows to resume, the accounts already moved: the loop takes the first
        out of the batch and puts the second back before the plan."""
        for sequence in left:
            self.leave(sequence)
        pause = self._to_pause(batch)
        self.pauses += len(pause)
        for sequence in pause:
            tenant = sequence.request.tenant
            self._running_rows[tenant] -= 1
            self._paused.setdefault(tenant, []).append(sequence)
        resume = self._to_resume() if self._prefill.partial is None else []
        return pause, resume

    def _to_pause(self, batch: Sequence[SequenceState]) -> list[SequenceState]:
        """Rows to pause: for each tenant below its share whose next request (or paused row) waits for rows the
        batch lacks, as many as it needs from the tenants furthest above their share, never below it, each
        tenant's newest rows first; none for a tenant whose need cannot be met so (nothing is paused for nothing)."""
        free = self.max_batch_size - sum(self._running_rows.values())
        held = dict(self._running_rows)
        pause: list[SequenceState] = []
        for tenant in [*self._paused, *(t for t in self._waiting if t not in self._paused)]:
            need = 1 if tenant in self._paused else self._head_rows(tenant)
            mine = held.get(tenant, 0)
            if need is None or need <= free or (mine and mine + need > self._share(tenant)):
                continue  # it fits now, or would not start even with the rows (admission's share)
            taken = self._victims(batch, tenant, need - free, held, pause)
            if taken:
                pause += taken
                held[tenant] = held.get(tenant, 0) + need  # as if started: the next tenant's need comes after
                free = 0
        return pause

    def _head_rows(self, tenant: str | None) -> int | None:
        """The rows of a tenant's first waiting interactive request, if its cache positions fit (pausing rows frees
        no positions); None otherwise."""
        request = next((r for r in self._waiting.get(tenant, ()) if not r.batch), None)
        if request is None or self.tokens_in_flight + request.cost > self.max_tokens_in_flight:
            return None
        return request.params.n

    def _victims(self, batch: Sequence[SequenceState], tenant: str | None, rows: int, held: dict[str | None, int],
                 chosen: list[SequenceState]) -> list[SequenceState]:
        """`rows` running rows of other tenants above their share (largest excess first, newest rows first), or none
        when they hold too few above it; `held` is moved when they are found."""
        excess = {t: math.floor(n - self._share(t)) for t, n in held.items() if t != tenant and n > self._share(t)}
        if sum(excess.values()) < rows:
            return []
        taken: list[SequenceState] = []
        for victim in sorted(excess, key=lambda t: -excess[t]):
            candidates = sorted((s for s in batch if s.request.tenant == victim and s not in chosen
                                 and s.finish_reason is None and not s.request.done), key=lambda s: len(s.tokens))
            count = min(excess[victim], rows - len(taken), len(candidates))
            taken += candidates[:count]
            held[victim] -= count
            if len(taken) == rows:
                return taken
        for sequence in taken:  # the batch held too few of their rows (the rest are prefilling): undo
            held[sequence.request.tenant] += 1
        return []

    def _to_resume(self) -> list[SequenceState]:
        """Paused rows that rejoin now: into free rows, tenants in turn, each within its share while others wait."""
        free = self.max_batch_size - sum(self._running_rows.values())
        resume: list[SequenceState] = []
        progress = True
        while free and progress:
            progress = False
            for tenant in list(self._paused):
                if not free or not self._within_share(tenant, 1, True):
                    continue
                sequence = self._paused[tenant].pop(0)
                if not self._paused[tenant]:
                    del self._paused[tenant]
                self._running_rows[tenant] = self._running_rows.get(tenant, 0) + 1
                resume.append(sequence)
                free -= 1
                progress = True
        return resume

    # -- the step (the engine's scheduler thread) --

    def schedule(self, batch: Sequence[SequenceState], *, left: Sequence[SequenceState] = (),
                 gone: Collection[int] = frozenset(), now: float, adapters: AdapterSlots | None = None) -> StepPlan:
        """The next step's plan for `batch` (the running rows, in row order): rows that `left` it since the last step
        give their share back and requests cancelled while queued (`gone`: their id()s) are dropped before
        admission; admitted requests start (their cached prefixes looked up); the prefill queue's next chunks take
        the cache rows after the batch's, within the measured budget while rows decode, the cap otherwise; the
        batch's rows get drafts when a speculative step pays."""
        for sequence in left:
            self.leave(sequence)
        dropped = [request for request in self._prefill.requests if id(request) in gone]
        if dropped:
            self._prefill.remove(self.cache, dropped)
            for request in dropped:
                self.release(request, request.params.n)
        admission = self.admit(gone, now, adapters)
        started = []
        for request in admission.admitted:
            if request.start():
                self._prefill.add(self.cache, request)
                started.append(request)
            else:  # its caller cancelled the future meanwhile: its rows go back
                self.release(request, request.params.n)
        self._prefill.follow(self.cache, len(batch))  # the part-way prompt's rows right after the batch's
        chunks = self._prefill.plan(self.budget.tokens(decoding=bool(batch)), len(batch))
        self._prefill.restore(self.cache, chunks)
        drafts, proposals = self._drafts(batch, [c.request for c in chunks if c.last])
        return StepPlan(admitted=tuple(started), expired=tuple(admission.expired),
                        cancelled=(*admission.cancelled, *dropped), failed=tuple(admission.failed),
                        decode=tuple(batch), drafts=drafts, proposals=proposals, prefill=tuple(chunks),
                        part_way=self._prefill.partial is not None)

    def _drafts(self, batch: Sequence[SequenceState], opening: list[Request]
                ) -> tuple[tuple[tuple[int, ...], ...], tuple[speculative.Proposal, ...]]:
        """Each batch row's draft and the proposal it was cut from, or none when the step does not speculate (the
        rows that prompts ending this step open count and must be eligible too: they take their first token in it).
        """
        if not self.speculative_tokens or not batch or \
                len(batch) + sum(r.params.n for r in opening) > self.speculative_max_rows or \
                not all(speculative.eligible(r) for r in [*(s.request for s in batch), *opening]):
            return (), ()
        proposals = [speculative.draft(s, self.speculative_tokens, self._context_length) for s in batch]
        # Measured step times price each checked position against what the decode rows yield alone (a step's prompt
        # tokens do not lower the bar: their time buys the prefill, not decode tokens).
        decode_s, position_s = self._costs.price(len(batch))
        taken = speculative.lengths([self._rates.yields(s, p) for s, p in zip(batch, proposals, strict=True)],
                                    decode_s, position_s)
        if not any(taken):
            return (), ()
        return tuple(tuple(p.tokens[:n]) for p, n in zip(proposals, taken, strict=True)), tuple(proposals)

    def update(self, plan: StepPlan, outcome: StepOutcome) -> None:
        """Take a step's outcome back: prompts that ended hand their blocks on (their other rows share them, the
        prefix cache keeps their full blocks), finished rows give their share back, and the step's time sizes later
        chunks and drafts (a checked draft position counts as the prompt token it costs as much as), each checked
        draft teaching the rates."""
        if outcome.prefilled:
            self._prefill.advance(self.cache, outcome.prefilled)
        for sequence in outcome.finished:
            self.leave(sequence)
        if outcome.decoded and not outcome.prefilled:
            self._costs.observe(outcome.decoded + outcome.drafted, outcome.seconds)
        self.budget.observe(outcome.seconds, bool(outcome.decoded),
                            sum(c.end - c.start for c in outcome.prefilled) + outcome.drafted)
        if outcome.drafted:
            for sequence, proposal, drafted, kept in zip(plan.decode, plan.proposals, plan.drafts, outcome.kept,
                                                         strict=False):
                self._rates.record(sequence, proposal, list(drafted), list(kept))

    # -- when a step fails, when nothing runs, at shutdown --

    def abort(self, requests: list[Request], left: Sequence[SequenceState], rows: int) -> None:
        """Requests whose prefill failed are dropped with their rows (`left`: those they opened, already out of the
        batch of `rows` rows); every cache row past the batch and a part-way prompt goes back."""
        self._prefill.remove(self.cache, requests)
        for request in requests:
            if not request.sequences:
                self.release(request, request.params.n)
        for sequence in left:
            self.leave(sequence)
        self._prefill.follow(self.cache, rows)
        partial = self._prefill.partial
        self.cache.free_rows_from(self._prefill.tail + partial.params.n if partial is not None else rows)

    def reset(self, left: Sequence[SequenceState]) -> list[Request]:
        """After a failed forward the cache is suspect: the batch's rows (`left`) give their share back, the prompts
        being prefilled are dropped (returned, to fail) and the cache and the prefix cache start empty."""
        for sequence in left:
            self.leave(sequence)
        dropped = self._drop_prefill()
        for request in dropped:
            self.release(request, request.params.n)
        return dropped

    def idle(self) -> None:
        """Nothing runs: give the cache's memory back, keeping only the prefix cache's blocks (compacted)."""
        self._prefill.idle(self.cache)

    def drain(self) -> list[Request]:
        """Empty the queues and the cache (the engine is closing); returns what waited and what was being prefilled."""
        waiting = self.waiting
        self._waiting.clear()
        self._waiting_rows.clear()
        self._paused.clear()
        return [*waiting, *self._drop_prefill()]

    def _drop_prefill(self) -> list[Request]:
        if self._cache is None:  # admission only (the vLLM engine's use): nothing was ever prefilled here
            return []
        dropped = list(self._prefill.requests)
        self._prefill.remove(self.cache, dropped)
        self._prefill.clear(self.cache)
        return dropped

    def stats(self) -> dict[str, int | None]:
        """Occupancy counters for the engine's stats()."""
        return {"waiting": sum(len(queue) for queue in self._waiting.values()),
                "waiting_rows": sum(self._waiting_rows.values()), "prefilling": len(self._prefill.requests),
                "tokens_in_flight": self.tokens_in_flight, "waiting_tenants": len(self._waiting),
                "prefill_budget_tokens": self.budget.tokens(decoding=True),
                "paused_rows": sum(len(rows) for rows in self._paused.values()), "pauses": self.pauses,
                "prefix_cache_blocks": self._prefill.cached_blocks}
