"""The inference worker shares its model round robin over tenants, drops work whose caller has gone, and bounds a
request's tokens: its real task code (serve_embed) in threads, as the threads pool runs it, over Redis."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from core.embeddings import EmbedResult, EmbedTask
from core.redis_keys import abandoned_key, embed_reply_key
from worker.servers import embeddings as embedding
from worker.servers import fair_turns
from worker.servers.fair_turns import Abandoned, FairTurns

BIG = [f"sentence number {i} about cats, markets and the weather in spring" for i in range(600)]


def test_turns_go_round_robin_over_tenants():
    turns, order = FairTurns(), []
    started = threading.Event()

    def run(tenant: str, batches: int) -> None:
        for i in range(batches):
            with turns.turn(tenant):
                order.append(f"{tenant}{i}")
                started.set()
                time.sleep(0.1)

    long = [threading.Thread(target=run, args=("a", 6)) for _ in range(2)]  # two requests of one tenant
    for thread in long:
        thread.start()
    started.wait(5)
    short = [threading.Thread(target=run, args=(t, 1)) for t in ("b", "c")]
    for thread in short:
        thread.start()
    for thread in [*long, *short]:
        thread.join(10)
    # b and c wait only for the batch running when they came: not for the other request of a queued before them
    assert set(order[1:3]) == {"b0", "c0"}, order
    assert sorted(x for x in order if x.startswith("a")) == sorted([f"a{i}" for i in range(6)] * 2)


def test_a_waiting_batch_whose_caller_left_is_dropped(monkeypatch):
    monkeypatch.setattr(fair_turns, "RECHECK_S", 0.05)
    turns, gone, outcome = FairTurns(), threading.Event(), []

    def wait() -> None:
        try:
            with turns.turn("b", gone=gone.is_set):
                outcome.append("ran")
        except Abandoned:
            outcome.append("dropped")

    with turns.turn("a"):
        waiter = threading.Thread(target=wait)
        waiter.start()
        gone.set()
        waiter.join(5)
    assert outcome == ["dropped"]
    with turns.turn("c"):  # the turn is free again
        pass


def _layers(turns: FairTurns, tenant: str, batches: int, layers: int, layer_s: float, log: list) -> None:
    """A request of `batches` batches, each `layers` layers of `layer_s` seconds, pausing between layers."""
    for batch in range(batches):
        with turns.turn(tenant) as pause:
            for layer in range(layers):
                pause()
                log.append((tenant, batch, layer, time.monotonic()))
                time.sleep(layer_s)


def test_another_tenants_request_waits_one_layer_of_a_long_batch_not_the_batch():
    """Batches were the unit of a turn: a one-sentence request waited for the whole running batch of a long one."""
    turns, log = FairTurns(), []
    heavy = threading.Thread(target=_layers, args=(turns, "heavy", 3, 10, 0.03, log))
    heavy.start()
    time.sleep(0.1)  # the heavy tenant's first batch (10 layers, 0.3 s) is running
    sent = time.monotonic()
    _layers(turns, "light", 1, 2, 0.01, log)
    heavy.join(10)
    light = [at for tenant, _, _, at in log if tenant == "light"]
    assert light[0] - sent < 0.1, "the light request waited for more than a layer"
    # It ran both its layers before the heavy batch went on, and the heavy batch resumed where it paused.
    order = [(tenant, batch, layer) for tenant, batch, layer, _ in log]
    first = order.index(("light", 0, 0))
    assert order[first + 1] == ("light", 0, 1) and order[first - 1][:2] == ("heavy", 0)
    assert [x for x in order if x[0] == "heavy"] == [("heavy", b, i) for b in range(3) for i in range(10)]


def test_two_busy_tenants_share_the_model_by_compute_time():
    turns, log = FairTurns(), []
    # One tenant's layers take 4x another's: in turns of batches it would get 4x the time; by compute it gets ~1x.
    threads = [threading.Thread(target=_layers, args=(turns, tenant, 40, 5, layer_s, log))
               for tenant, layer_s in (("slow", 0.02), ("fast", 0.005))]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    slow, fast = turns.charged("slow"), turns.charged("fast")
    for thread in threads:
        thread.join(30)
    assert 0.6 < slow / fast < 1.6, (slow, fast)


def test_an_idle_tenant_banks_no_more_than_the_arrival_credit():
    turns = FairTurns()
    with turns.turn("a"):
        time.sleep(0.05)
    with turns.turn("busy") as pause:
        time.sleep(0.6)
        pause()
        with turns._cond:  # a returns while busy computes: put at busy's charge less the credit, not far behind
            turns._arrive("a")
            assert turns._vtime["a"] == pytest.approx(turns._vtime["busy"] - fair_turns.ARRIVAL_CREDIT_S, abs=0.01)


@pytest.fixture()
def ctx(settings, queue):
    from worker.context import WorkerContext

    ctx = WorkerContext(settings, queue)
    yield ctx
    ctx.close()


def _task(tenant: str, texts: list[str], timeout: float = 120) -> EmbedTask:
    return EmbedTask(request_id=f"emb-{uuid.uuid4().hex}", model="minilm-l6", texts=texts,
                     deadline=time.time() + timeout, tenant=tenant)


def _serve(ctx, task: EmbedTask, outcome: dict) -> None:
    outcome["status"] = embedding.serve_embed(ctx, task.model_dump(mode="json"))
    outcome["at"] = time.monotonic()


@pytest.mark.alone  # a latency ratio: another test file's training on the same cores skews it
def test_a_one_sentence_request_is_served_between_the_batches_of_another_tenants_long_one(ctx):
    """The worker served in arrival order: 2,048-input requests of one tenant made the other's sentence a 504."""
    embedding.embed(ctx, _task("warm", ["warm the model up"]))
    big, small = _task("hostile", BIG), _task("normal", ["one short sentence"])
    long, short = {}, {}
    worker = threading.Thread(target=_serve, args=(ctx, big, long))
    worker.start()
    time.sleep(0.5)  # the long request is computing its batches
    sent = time.monotonic()
    _serve(ctx, small, short)
    worker.join(120)
    assert short["status"] == long["status"] == "answered"
    assert short["at"] < long["at"], "the short request waited for the whole long one"
    assert short["at"] - sent < (long["at"] - sent) / 3
    reply = EmbedResult.model_validate_json(ctx.redis.lpop(embed_reply_key(small.request_id)))
    assert reply.error is None and len(reply.embeddings or []) == 1


def test_the_rest_of_a_request_is_dropped_once_its_caller_has_gone(ctx):
    embedding.embed(ctx, _task("warm", ["warm the model up"]))
    big, outcome = _task("hostile", BIG * 2), {}
    worker = threading.Thread(target=_serve, args=(ctx, big, outcome))
    started = time.monotonic()
    worker.start()
    time.sleep(0.5)
    ctx.redis.set(abandoned_key(big.request_id), "1", ex=60)  # the API gave up (timeout or disconnect)
    worker.join(120)
    assert outcome["status"] == "skipped" and outcome["at"] - started < 5
    assert ctx.redis.llen(embed_reply_key(big.request_id)) == 0  # nobody reads it: nothing is pushed


def test_a_request_over_the_token_bound_is_refused_naming_input(ctx, settings):
    settings.max_embedding_tokens = 100
    result = embedding.embed(ctx, _task("t", ["a few words of text"] * 20))
    assert result.error is not None and result.error.field == "input" and "at most 100" in result.error.message
