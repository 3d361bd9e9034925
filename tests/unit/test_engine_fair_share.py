"""The engine shares its rows between tenants: one tenant's queue of n=4 requests, all submitted before another
tenant's one-line chat, does not hold that chat back until the queue drains (first come, first served did)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from core.protocol import SamplingParams
from worker.engines.generation.engine import GenerationEngine


@pytest.fixture(scope="module")
def engine(tiny_gpt2_dir: Path):
    with GenerationEngine(tiny_gpt2_dir, device="cpu", precision="fp32", max_batch_size=8) as eng:
        yield eng


def test_a_flood_of_n4_requests_does_not_hold_back_another_tenants_chat(engine: GenerationEngine) -> None:
    started: dict[str, float] = {}

    def first_token(name: str):
        def on_token(index: int, text: str) -> None:
            started.setdefault(name, time.monotonic())
        return on_token

    flood = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, n=4)
    with engine._lock:  # everything is waiting before the scheduler's first admission
        floods = [engine.submit([464, 318, 11], flood, tenant="flood", on_token=first_token(f"flood-{i}"),
                                request_id=f"flood-{i}") for i in range(6)]
        chat = engine.submit([464, 3290], SamplingParams(max_new_tokens=4, temperature=0.0), tenant="chat",
                             on_token=first_token("chat"), request_id="chat")
    chat.result(timeout=120)
    for future in floods:
        future.result(timeout=120)
    # Rows 8, each flood request 4 of them: first come, first served runs flood-0 and flood-1, then flood-2..5,
    # and the chat last. Tenants in turn: the chat starts in the first step, beside flood-0.
    assert started["chat"] <= started["flood-1"]
    assert started["chat"] < started["flood-2"]
    # The flooding tenant is held to its share while the chat waits, and takes every row once it is alone.
    assert engine.stats()["peak_running_sequences"] == 8


def test_a_tenant_holding_every_row_pauses_one_for_a_newcomer_and_its_output_is_unchanged(tiny_gpt2_dir: Path) -> None:
    """Tenant A's n=4 request holds all 4 rows for 120 tokens; tenant B's chat, sent once A is decoding, does not
    wait for A's rows to end: one of A's rows pauses (its keys and values kept) and resumes after the chat. A's
    choices are the tokens the same request draws alone (seeded, with a repetition penalty: what a row has seen is
    kept too), and the chat's are its greedy tokens alone."""
    flood = SamplingParams(max_new_tokens=120, temperature=1.0, seed=5, n=4, repetition_penalty=1.3)
    chat = SamplingParams(max_new_tokens=4, temperature=0.0)
    with GenerationEngine(tiny_gpt2_dir, device="cpu", precision="fp32", max_batch_size=4) as eng:
        alone = eng.submit([464, 318, 11], flood, tenant="a").result(timeout=120)
        chat_alone = eng.submit([464, 3290], chat, tenant="b").result(timeout=120)
        decoding = threading.Event()
        shared = eng.submit([464, 318, 11], flood, tenant="a", on_token=lambda i, text: decoding.set())
        assert decoding.wait(60)
        paused_before = eng.stats()["paused_rows"]
        reply = eng.submit([464, 3290], chat, tenant="b").result(timeout=120)
        assert not shared.done()  # the chat ended while A's rows still decode
        result = shared.result(timeout=120)
        stats = eng.stats()
        assert stats["paused_rows"] == 0 and stats["pauses"] >= 1 and stats["peak_running_sequences"] == 4
    assert paused_before == 0
    assert [c.token_ids for c in result.choices] == [c.token_ids for c in alone.choices]
    assert [c.text for c in result.choices] == [c.text for c in alone.choices]
    assert reply.choices[0].token_ids == chat_alone.choices[0].token_ids
    assert min(len(c.token_ids) for c in alone.choices) > 20  # long enough that the chat could not just wait
