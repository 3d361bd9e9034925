"""The generation scheduler alone (no model): admission in rows and cache positions, tenants in turn, each within
its share of the rows while others have work, interactive requests before batch lines, the queue bound in rows
with a tenant's part of it, and the adapter-slot constraint."""

from __future__ import annotations

import pytest

from core.protocol import SamplingParams
from worker.engines.generation.lora.adapter_cache import AdapterCacheFull
from worker.engines.generation.requests import AdapterUse, QueueFull, Request
from worker.engines.generation.scheduler import Scheduler


def request(name: str, tenant: str | None = None, *, n: int = 1, prompt: int = 4, new: int = 8,
            batch: bool = False, adapter: str | None = None) -> Request:
    params = SamplingParams(max_new_tokens=new, n=n, temperature=1.0 if n > 1 else 0.0)
    return Request(name, list(range(prompt)), params, None, None, None, tenant=tenant, batch=batch,
                   adapter=AdapterUse(adapter) if adapter else None)


def names(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def scheduler(**kwargs) -> Scheduler:
    return Scheduler(**{"max_batch_size": 8, "max_tokens_in_flight": 10_000, "max_queue": 64, **kwargs})


def test_one_tenant_alone_is_first_come_first_served_in_rows():
    s = scheduler()
    for r in [request("a", n=4), request("b", n=4), request("c", n=1)]:
        s.add(r)
    a, b = s.admit(set(), 0.0, None).admitted  # 8 rows: c waits behind them
    assert names([a, b]) == ["a", "b"] and s.tokens_in_flight == 2 * 4 * 12
    s.release(a, 4)
    assert names(s.admit(set(), 0.0, None).admitted) == ["c"] and s.tokens_in_flight == 4 * 12 + 12


def test_a_flooding_tenant_cannot_take_the_rows_another_tenant_needs():
    """Tenant A's n=4 requests arrive first; B's one-row chat is admitted in the first free round, and A stays
    within half the rows while B has work."""
    s = scheduler()
    flood = [request(f"a{i}", "A", n=4) for i in range(6)]
    for r in flood:
        s.add(r)
    s.add(request("b0", "B"))
    first = s.admit(set(), 0.0, None).admitted
    # Round robin: A's first, then B's, then A is at its share (4 of 8 rows with B active): nothing more of A.
    assert names(first) == ["a0", "b0"]
    s.release(first[1], 1)  # B's chat ends
    assert names(s.admit(set(), 0.0, None).admitted) == ["a1"]  # B has no work left: A may use every row


def test_a_waiting_tenants_large_request_gets_the_rows_another_tenant_frees():
    """A's one-row requests fill the batch; B's n=4 request arrives. A does not take rows back as they free (it is
    over its share while B waits), so B starts once four are free instead of starving."""
    s = scheduler()
    for i in range(12):
        s.add(request(f"a{i}", "A"))
    running = s.admit(set(), 0.0, None).admitted
    assert len(running) == 8
    s.add(request("b", "B", n=4))
    for r in running[:2]:
        s.release(r, 1)
    assert s.admit(set(), 0.0, None).admitted == []  # two free rows: not enough for b, and A is over its share
    for r in running[2:4]:
        s.release(r, 1)
    assert names(s.admit(set(), 0.0, None).admitted) == ["b"]


def test_spare_rows_let_a_newcomer_start_beside_a_tenant_over_its_share_and_no_one_else():
    """An engine that cannot pause rows (vLLM's) has spare rows: A alone fills the 8 rows; B's chat starts in a spare
    row at once, while A's next request does not (it is over its share); with A within its share, B waits."""
    s = scheduler(spare_rows=4)
    for i in range(3):
        s.add(request(f"a{i}", "A", n=4))
    assert names(s.admit(set(), 0.0, None).admitted) == ["a0", "a1"]  # 8 rows: the batch, no spare row for A alone
    s.add(request("b0", "B", n=2))
    assert names(s.admit(set(), 0.0, None).admitted) == ["b0"]  # 10 rows: B within its share, A over its own
    s.add(request("c0", "C", n=3))  # within its share (8 / 3 tenants), but the spare rows have 2 left
    assert names(s.admit(set(), 0.0, None).admitted) == []
    plain = scheduler()
    for r in [request("a0", "A", n=4), request("a1", "A", n=4), request("b0", "B")]:
        plain.add(r)
    assert names(plain.admit(set(), 0.0, None).admitted) == ["a0", "b0"]  # rows free: no spare row needed


def test_tenants_take_turns_across_admissions():
    s = scheduler(max_batch_size=2)
    for r in [request("a0", "A"), request("a1", "A"), request("a2", "A"), request("b0", "B"), request("b1", "B")]:
        s.add(r)
    order: list[str] = []
    for _ in range(5):
        admitted = s.admit(set(), 0.0, None).admitted
        order += names(admitted)
        for r in admitted:
            s.release(r, 1)
    assert order == ["a0", "b0", "a1", "b1", "a2"]


def test_interactive_requests_are_admitted_before_batch_lines():
    s = scheduler(max_batch_size=3)
    for i in range(4):
        s.add(request(f"line{i}", "A", batch=True))
    s.add(request("chat", "B"))
    assert names(s.admit(set(), 0.0, None).admitted) == ["chat", "line0", "line1"]


def test_the_queue_bound_counts_rows_and_a_tenant_fills_only_its_share():
    s = scheduler(max_queue=32, tenant_queue_share=0.5)
    s.add(request("a0", "A", n=16))
    with pytest.raises(QueueFull, match="its share of the queue is 16"):
        s.add(request("a1", "A", n=1))
    s.add(request("b0", "B", n=16))  # the other half is open to another tenant
    with pytest.raises(QueueFull, match="32 rows are already waiting"):
        s.add(request("c0", "C"))


def test_cancelled_and_expired_waiting_requests_are_dropped_before_admission():
    s = scheduler()
    gone, late, kept = request("gone", "A"), request("late", "A"), request("kept", "B")
    late.deadline = 1.0
    for r in (gone, late, kept):
        s.add(r)
    admission = s.admit({id(gone)}, now=2.0, adapters=None)
    assert names(admission.cancelled) == ["gone"] and names(admission.expired) == ["late"]
    assert names(admission.admitted) == ["kept"] and s.waiting == []


class OneSlot:
    """An adapter store with one slot: a second adapter waits until the first is released."""

    def __init__(self) -> None:
        self.held: str | None = None

    def __contains__(self, name: object) -> bool:
        return name == self.held

    def acquire(self, request: Request) -> None:
        assert request.adapter is not None
        if self.held not in (None, request.adapter.name):
            raise AdapterCacheFull("the one slot is in use")
        self.held = request.adapter.name


def test_a_request_waiting_for_an_adapter_slot_lets_base_and_resident_requests_pass():
    s, slots = scheduler(), OneSlot()
    for r in [request("x0", adapter="x"), request("y0", adapter="y"), request("base"), request("y1", adapter="y"),
              request("x1", adapter="x")]:
        s.add(r)
    admitted = s.admit(set(), 0.0, slots).admitted
    # y0 waits for the slot x holds; the base request and x1 (resident) pass it, y1 keeps behind y0.
    assert names(admitted) == ["x0", "base", "x1"] and names(s.waiting) == ["y0", "y1"]
