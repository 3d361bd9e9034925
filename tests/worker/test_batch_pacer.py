"""The batch Pacer: a batch's requests in an engine stay within `busy` rows while interactive requests are there
(and for a while after), and fill `idle` rows once the engine has had none."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from core.batches import PlannedLine
from worker.batches import lines as batch_runner
from worker.batches.lines import Pacer, Share

LINE = PlannedLine(custom_id="a", url="/v1/completions")


class FakeEngine:
    """stats() and submit() as the generation engine has them; `interactive` requests are someone else's."""

    def __init__(self) -> None:
        self.interactive = 0
        self.futures: list[Future] = []

    def stats(self) -> dict:
        return {"running": self.interactive + sum(not f.done() for f in self.futures), "waiting": 0}

    def submit(self, ids, params, *, request_id, adapter=None, tenant=None, batch=False):
        assert batch  # batch lines go after interactive requests in the engine's scheduler
        future: Future = Future()
        self.futures.append(future)
        return future


def _submit_in_background(pacer: Pacer, engine: FakeEngine, count: int) -> threading.Thread:
    thread = threading.Thread(target=lambda: [pacer.submit(engine, [1], LINE, f"r{i}") for i in range(count)],
                              daemon=True)
    thread.start()
    return thread


def test_the_share_shrinks_beside_interactive_requests_and_grows_after_a_quiet_spell(monkeypatch):
    monkeypatch.setattr(batch_runner, "BUSY_HOLD_S", 1.0)
    engine = FakeEngine()
    pacer = Pacer(Share(busy=2, idle=5))
    _submit_in_background(pacer, engine, 5).join(2)
    assert len(engine.futures) == 5  # nobody else: the idle share
    engine.interactive = 1
    for future in engine.futures:
        future.set_result(None)
    thread = _submit_in_background(pacer, engine, 4)
    _until(lambda: len(engine.futures) == 7)
    thread.join(0.1)
    assert len(engine.futures) == 7 and pacer.in_flight == 2  # beside interactive requests: 2 rows at most
    engine.interactive = 0
    thread.join(0.05)
    assert len(engine.futures) == 7  # still within the hold after interactive traffic
    thread.join(5)
    assert len(engine.futures) == 9 and pacer.in_flight == 4  # a quiet spell: up to the idle share again


def _until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_work_outside_the_engines_gives_way_to_interactive_requests_in_any_of_them(monkeypatch):
    monkeypatch.setattr(batch_runner, "BUSY_HOLD_S", 0.3)
    slept: list[float] = []
    monkeypatch.setattr(batch_runner.time, "sleep", slept.append)
    quiet, busy = FakeEngine(), FakeEngine()
    pacer = Pacer(Share(busy=1, idle=4, time=0.25))
    assert pacer.give_way([quiet], 0.2) == 0.0 and slept == []  # nobody waiting: the batch runs flat out
    busy.interactive = 1
    pause = pacer.give_way([quiet, busy], 0.2)
    assert abs(pause - 0.6) < 1e-9 and slept == [pause]  # 0.2 s of work, then 0.6 s: a quarter of the time
    busy.interactive = 0
    assert pacer.give_way([quiet, busy], 0.1) > 0  # within the hold after the interactive request left
    real_sleep = threading.Event().wait
    real_sleep(0.35)
    assert pacer.give_way([quiet, busy], 0.1) == 0.0  # a quiet spell: flat out again
    busy.interactive = 1
    assert Pacer(Share(busy=1, idle=4)).give_way([busy], 1.0) == 0.0  # a time share of 1: never pauses
