"""A tenant runs at most batch_runs_per_tenant batches at once: a third batch's task ends without running it and
the reaper hands it on later; another tenant's batch is not held back; a slot frees when its batch ends, and a
runner that died leaves a slot that expires after batch_stale_s."""

from __future__ import annotations

import time

import pytest

from core.redis_keys import tenant_batches_key


@pytest.fixture()
def ctx(settings, queue):
    from worker.context import WorkerContext

    settings.batch_runs_per_tenant, settings.batch_stale_s = 2, 1.0
    ctx = WorkerContext(settings, queue)
    ctx.redis.delete(tenant_batches_key("a"), tenant_batches_key("b"))
    yield ctx
    ctx.close()


def test_a_tenant_runs_at_most_its_limit_of_batches(ctx):
    from worker.batches.leases import TenantRuns

    first, second = TenantRuns(ctx, "a", "batch_1"), TenantRuns(ctx, "a", "batch_2")
    assert first.acquire() and second.acquire()
    third = TenantRuns(ctx, "a", "batch_3")
    assert not third.acquire()  # the tenant's limit: it waits for the reaper
    assert first.acquire()  # a redelivery of a running batch keeps its slot
    assert TenantRuns(ctx, "b", "batch_4").acquire()  # another tenant is not held back
    first.release()
    assert third.acquire()  # a finished batch frees its slot


def test_a_dead_runners_slot_expires_and_a_live_one_is_kept_fresh(ctx):
    from worker.batches.leases import TenantRuns

    dead, live = TenantRuns(ctx, "a", "batch_1"), TenantRuns(ctx, "a", "batch_2")
    assert dead.acquire() and live.acquire()
    time.sleep(0.7)
    live.renew()  # the heartbeat of a running batch
    time.sleep(0.5)  # past batch_stale_s since the dead runner's last beat
    waiting = TenantRuns(ctx, "a", "batch_3")
    assert waiting.acquire()
    assert not TenantRuns(ctx, "a", "batch_5").acquire()  # the live one and the new one hold the two slots
