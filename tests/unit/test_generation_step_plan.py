"""The seam between the generation scheduler and the step loop: one plan per step as plain data, one outcome back,
and neither the loop nor the client reaching into the scheduler's state."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from core.protocol import SamplingParams
from worker.engines.generation.caches.paged_cache import BLOCK, PagedCache
from worker.engines.generation.prefill import Chunk
from worker.engines.generation.requests import Request
from worker.engines.generation.scheduler import Scheduler
from worker.engines.generation.step import StepOutcome, StepPlan

GENERATION = Path(__file__).resolve().parents[2] / "worker" / "engines" / "generation"
SHARED = list(range(100, 100 + 2 * BLOCK))  # two full blocks of prompt both requests start with


def request(name: str, prompt: list[int], *, new: int = 8, deadline: float | None = None) -> Request:
    return Request(name, prompt, SamplingParams(max_new_tokens=new, temperature=0), None, None, deadline)


def bound_scheduler() -> tuple[Scheduler, PagedCache]:
    cache = PagedCache(n_layer=1, cache_heads=1, head_dim=4, device=torch.device("cpu"), dtype=torch.float32)
    scheduler = Scheduler(max_batch_size=4, max_tokens_in_flight=1000, max_queue=8, prefill_chunk_tokens=2048,
                          prefix_cache_bytes=1 << 20)
    scheduler.bind(cache, context_length=256)
    return scheduler, cache


def test_a_step_with_a_waiting_request_a_decoding_row_and_a_prefix_hit_is_planned_as_plain_data():
    scheduler, cache = bound_scheduler()
    first = request("first", SHARED + [1, 2, 3])
    scheduler.add(first)
    plan = scheduler.schedule([], now=0.0)
    assert plan == StepPlan(admitted=(first,), prefill=(Chunk(first, 0, len(first.prompt), (0,)),))
    cache.prepare(0, 0, len(first.prompt))  # what the runner's forward does: the prompt's blocks written
    scheduler.update(plan, StepOutcome(0.01, prefilled=plan.prefill))
    (row,) = first.open(lambda: None)  # its prompt ended: its row joins the batch (the prefix cache kept 2 blocks)
    row.tokens.append(7)

    second = request("second", SHARED + [4, 5, 6, 7, 8])
    late = request("late", [9, 9], deadline=1.0)
    gone = request("gone", [8, 8])
    for waiting in (second, late, gone):
        scheduler.add(waiting)
    plan = scheduler.schedule([row], gone={id(gone)}, now=2.0)

    # Plain data: a frozen dataclass of tuples of requests, rows and chunks (no tensors, no scheduler state).
    assert dataclasses.is_dataclass(plan) and not any(isinstance(v, torch.Tensor) for v in vars(plan).values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.decode = ()  # type: ignore[misc]
    assert plan.admitted == (second,) and plan.expired == (late,) and plan.cancelled == (gone,)
    assert plan.failed == () and plan.decode == (row,) and plan.drafts == () and not plan.part_way
    assert second.cached_tokens == 2 * BLOCK  # the prefix cache's hit: only the rest of the prompt is prefilled
    assert plan.prefill == (Chunk(second, 2 * BLOCK, len(second.prompt), (1,)),)  # the row after the batch's
    assert cache.table(1)[:2] == cache.table(0)[:2]  # its row starts from the cached blocks, by reference
    assert scheduler.tokens_in_flight == first.cost + second.cost

    # The outcome back: the prompt that ended leaves the prefill queue, the finished row gives its share back.
    row.finish_reason = "length"
    cache.prepare(1, 2 * BLOCK, len(second.prompt))
    scheduler.update(plan, StepOutcome(0.02, decoded=1, prefilled=plan.prefill, kept=((7,), (5,)), finished=(row,)))
    assert scheduler.tokens_in_flight == second.cost
    assert scheduler.stats()["prefilling"] == 0 and not scheduler.busy


def test_a_long_prompt_is_planned_in_chunks_and_its_rows_follow_the_batch():
    scheduler, cache = bound_scheduler()
    scheduler.budget.cap = 8  # chunks of at most 8 tokens
    long = request("long", list(range(20)))
    scheduler.add(long)
    plan = scheduler.schedule([], now=0.0)
    assert plan.prefill == (Chunk(long, 0, 8, (0,)),)
    cache.prepare(0, 0, 8)
    scheduler.update(plan, StepOutcome(0.01, prefilled=plan.prefill))
    plan = scheduler.schedule([], now=0.0)
    assert plan.prefill == (Chunk(long, 8, 16, (0,)),) and plan.part_way


def _attributes_used(path: Path, owner: str) -> set[str]:
    """Attributes read through `<owner>` or `self.<owner>` in a module."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            value = node.value
            name = value.attr if isinstance(value, ast.Attribute) else getattr(value, "id", None)
            if name == owner:
                used.add(node.attr)
    return used


def test_the_loop_and_the_client_use_the_scheduler_through_its_public_methods_only():
    loop = _attributes_used(GENERATION / "step_loop.py", "scheduler")
    client = _attributes_used(GENERATION / "engine.py", "scheduler")
    assert not [name for name in loop | client if name.startswith("_")]
    assert loop <= {"bind", "queued", "busy", "rebalance", "schedule", "update", "abort", "reset", "idle", "drain",
                    "max_batch_size"}, loop
    assert client <= {"add", "stats"}, client
    for module in ("engine.py", "step_loop.py"):  # nor the scheduler's prefill queue and prefix cache
        tree = ast.parse((GENERATION / module).read_text())
        names = {getattr(node, "attr", None) or getattr(node, "id", None) for node in ast.walk(tree)}
        names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
        assert not names & {"prefilling", "PrefillQueue", "PrefixCache", "prefix"}, module


def test_each_step_makes_three_calls_to_the_scheduler_rebalance_schedule_then_update():
    """Rows to pause and resume (plain lists, applied by the loop to its rows), the plan, the outcome back."""
    tree = ast.parse((GENERATION / "step_loop.py").read_text())
    step = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "step")
    calls = [node.func.attr for node in ast.walk(step) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Attribute)
             and node.func.value.attr == "scheduler"]
    assert calls == ["rebalance", "schedule", "update"]
