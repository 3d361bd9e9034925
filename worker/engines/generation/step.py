"""What crosses the seam between the scheduler and the step loop, once per step, as vLLM's engine core passes its
`SchedulerOutput` and `ModelRunnerOutput`: `Scheduler.schedule()` returns a StepPlan (what to start, drop, prefill,
decode and draft), the loop runs it on the runner and hands a StepOutcome (what the step produced and how long it
took) back to `Scheduler.update()`. Both are plain data; neither side reaches into the other's state.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.engines.generation.prefill import Chunk
from worker.engines.generation.requests import Request, SequenceState
from worker.engines.generation.speculative import Proposal


@dataclass(frozen=True)
class StepPlan:
    """One step as the scheduler decided it.

    The requests it started and dropped are the loop's to resolve; the rest is what the runner runs: the batch's
    rows decode one token each (a row with a draft checks it too, its tokens at consecutive positions), and the
    prompt chunks prefill in the same forward into the cache rows each names (right after the batch's).
    """

    admitted: tuple[Request, ...] = ()  # started: their prompts queued for prefill, cached prefixes found
    expired: tuple[Request, ...] = ()  # waited past their deadline
    cancelled: tuple[Request, ...] = ()  # dropped while waiting or prefilling: their callers went away
    failed: tuple[tuple[Request, Exception], ...] = ()  # could not start (e.g. an adapter that would not load)
    decode: tuple[SequenceState, ...] = ()  # rows 0..B-1 of the batch, in row order
    drafts: tuple[tuple[int, ...], ...] = ()  # per decode row, the draft tokens to check (none: a plain step)
    proposals: tuple[Proposal, ...] = ()  # per decode row, the proposal its draft was cut from (for the rates)
    prefill: tuple[Chunk, ...] = ()  # prompt chunks, each with its cache rows
    part_way: bool = False  # a part-way prompt holds the cache rows after the batch's (a padded step must not)

    @property
    def runs(self) -> bool:
        """Whether the step has anything for the runner."""
        return bool(self.decode or self.prefill)

    @property
    def draft_positions(self) -> int:
        """The draft tokens the step checks."""
        return sum(len(draft) for draft in self.drafts)


@dataclass(frozen=True)
class StepOutcome:
    """What one step produced, as the loop hands it back to the scheduler."""

    seconds: float  # the step's wall time on the runner (forward, draw and the rows' tokens taken)
    decoded: int = 0  # batch rows that decoded (0: a step of prompt chunks alone, or a failed forward)
    drafted: int = 0  # draft positions it checked
    prefilled: tuple[Chunk, ...] = ()  # the chunks whose tokens went into the cache (a failed forward's did not)
    kept: tuple[tuple[int, ...], ...] = ()  # per row, the tokens it kept (a checked draft's agreed prefix, then one)
    finished: tuple[SequenceState, ...] = ()  # rows that leave the batch (finished, or their request ended)
