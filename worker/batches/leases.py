"""Keeping a batch to one holder, and handing on the batches of a worker that died.

The task running a batch (its holder) holds a lease in Redis (SET NX with a time to live of `batch_stale_s`) and beats
the batch's heartbeat while it runs; a redelivered task that finds the lease held ends at once. Each generation
worker's reaper hands a batch whose heartbeat is older than `batch_stale_s` to the queue again (claimed with one
conditional UPDATE, so one reaper sends it); the task that takes it resumes from the stored parts
(worker.batches.run). A tenant runs at most `batch_runs_per_tenant` batches at once: a task for one more ends without
running it, and the reaper hands it on again once its heartbeat is stale, when a slot may have freed.
"""

from __future__ import annotations

import logging
import time
import uuid
from datetime import timedelta

from redis.exceptions import RedisError

from core.batches import beat, claim_stale, stale_ids
from core.db import session_scope
from core.logs import task_headers
from core.periodic import Periodic
from core.redis_keys import batch_lock_key, tenant_batches_key
from core.rows import utcnow
from core.tasks import QUEUE_GENERATE, TASK_BATCH
from worker.context import WorkerContext

log = logging.getLogger(__name__)

# Delete the lease only while it is still ours (a holder that stalled past its lease must not free another's).
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end return 0"
# KEYS[1]: a tenant's running batches (id, last beat); ARGV: now, ttl, limit, batch id, key ttl. Drops slots not
# beaten for ttl; keeps or adds the batch's slot below the limit (1), else 0.
_TAKE_RUN = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[1]) - tonumber(ARGV[2]))
if not redis.call('ZSCORE', KEYS[1], ARGV[4]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


class Lease:
    """The one-holder lease of a batch."""

    def __init__(self, ctx: WorkerContext, batch_id: str) -> None:
        self.redis = ctx.redis
        self.key = batch_lock_key(batch_id)
        self.token = uuid.uuid4().hex
        self.ttl = max(1, int(ctx.settings.batch_stale_s))

    def acquire(self) -> bool:
        return bool(self.redis.set(self.key, self.token, nx=True, ex=self.ttl))

    def renew(self) -> None:
        self.redis.eval(_RENEW, 1, self.key, self.token, str(self.ttl))

    def release(self) -> None:
        try:
            self.redis.eval(_RELEASE, 1, self.key, self.token)
        except RedisError:
            pass  # it expires on its own


class TenantRuns:
    """A tenant's running batches, at most `batch_runs_per_tenant` at once (a slot per running batch, kept fresh by
    the heartbeat; a holder that died leaves a slot that expires after `batch_stale_s`)."""

    def __init__(self, ctx: WorkerContext, tenant: str, batch_id: str) -> None:
        self.redis = ctx.redis
        self.key = tenant_batches_key(tenant)
        self.batch_id = batch_id
        self.limit = ctx.settings.batch_runs_per_tenant
        self.ttl = max(1.0, ctx.settings.batch_stale_s)

    def acquire(self) -> bool:
        """Take (or keep) this batch's slot; False when the tenant already runs its limit of other batches."""
        now = time.time()
        taken = self.redis.eval(_TAKE_RUN, 1, self.key, str(now), str(self.ttl), str(self.limit), self.batch_id,
                                str(int(self.ttl) + 1))
        return bool(taken)

    def renew(self) -> None:
        self.redis.zadd(self.key, {self.batch_id: time.time()}, xx=True)

    def release(self) -> None:
        try:
            self.redis.zrem(self.key, self.batch_id)
        except RedisError:
            pass  # it expires on its own


def heartbeat(ctx: WorkerContext, batch_id: str, lease: Lease, runs: TenantRuns | None = None) -> Periodic:
    """A thread renewing the lease, the tenant's run slot and the batch's heartbeat several times per
    `batch_stale_s`."""

    def work() -> None:
        lease.renew()
        if runs is not None:
            runs.renew()
        with session_scope(ctx.sessions) as session:
            beat(session, batch_id)

    return Periodic(f"batch-heartbeat-{batch_id}", max(0.5, ctx.settings.batch_stale_s / 4), work)


def resume_stale(ctx: WorkerContext) -> list[str]:
    """Send the task of every batch whose holder went silent; the ids sent."""
    before = utcnow() - timedelta(seconds=ctx.settings.batch_stale_s)
    sent = []
    with session_scope(ctx.sessions) as session:
        candidates = stale_ids(session, before=before)
    for batch_id in candidates:
        with session_scope(ctx.sessions) as session:
            if not claim_stale(session, batch_id, before=before):
                continue
        ctx.queue.send(TASK_BATCH, [batch_id], queue=QUEUE_GENERATE, headers=task_headers())
        log.warning("batch %s: its holder went silent; handed to the queue again", batch_id)
        sent.append(batch_id)
    return sent


def batch_reaper(ctx: WorkerContext) -> Periodic:
    """A daemon thread in each generation worker running resume_stale() periodically."""
    return Periodic("batch-reaper", max(1.0, min(ctx.settings.batch_stale_s / 2, 30.0)), lambda: resume_stale(ctx))
