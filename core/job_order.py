"""Which queued job runs next: weighted fair share between tenants, priority within one, per-tenant device limits.

A broker message only wakes a training worker; the worker then claims the job this module picks from SQL,
among the jobs of the message's size (`devices`: the queue the message came on):
    1. tenants with queued jobs, minus those whose device limit the job would exceed;
    2. ordered by recent device time / weight in quanta (less first), then by whose last job started longest
       ago (within a quantum tenants take turns), then by name;
    3. within the first tenant: highest priority, then oldest; claimed by core.states.claim.
On PostgreSQL the decision holds a transaction-scoped advisory lock, so two workers never both take a tenant's
last free device; SQLite serialises writers anyway, and the conditional UPDATE stops a double claim on both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, func, or_, select
from sqlalchemy.orm import Session

from core import states
from core.rows import Job, JobStatus
from core.settings import Settings

SCHEDULER_LOCK = 7_310_452  # pg_advisory_xact_lock key of the claim decision
EPOCH = datetime.min.isoformat()


@dataclass(frozen=True)
class TenantShare:
    """A tenant's standing in the queue."""

    tenant: str
    usage_s: float  # device seconds within the window (a job on N devices of M nodes counts N x M times)
    weight: float
    last_claim: datetime | None
    in_use: int  # devices its running jobs hold
    limit: int  # 0: none

    def blocks(self, devices: int) -> bool:
        """Whether a job on `devices` more devices would exceed the tenant's limit."""
        return 0 < self.limit < self.in_use + devices

    def key(self, quantum_s: float) -> tuple[int, str, str]:
        """Sort key: fewer weighted quanta first, then the longest wait since its last start."""
        last = self.last_claim.isoformat() if self.last_claim else EPOCH
        return math.floor(self.usage_s / self.weight / quantum_s), last, self.tenant


def shares(session: Session, settings: Settings, *, now: datetime) -> list[TenantShare]:
    """Every tenant with queued jobs, best turn first (those at their device limit included, flagged)."""
    since = now - timedelta(seconds=settings.fair_share_window_s)
    waiting = set(session.scalars(select(Job.tenant_id).where(Job.status == JobStatus.QUEUED).distinct()))
    if not waiting:
        return []
    recent = or_(Job.claimed_at >= since, Job.status == JobStatus.RUNNING)
    query = (select(Job.tenant_id, Job.status, Job.claimed_at, Job.run_seconds, Job.devices * Job.nodes)
             .where(Job.tenant_id.in_(sorted(waiting)), recent))
    usage = dict.fromkeys(waiting, 0.0)
    last: dict[str, datetime | None] = dict.fromkeys(waiting)
    in_use = dict.fromkeys(waiting, 0)
    for tenant, status, claimed_at, run_seconds, devices in session.execute(query).tuples():
        usage[tenant] += (run_seconds or 0.0) * devices
        if status == JobStatus.RUNNING:
            in_use[tenant] += devices
            if claimed_at is not None:  # the run in progress counts up to now
                usage[tenant] += max((now - claimed_at).total_seconds(), 0.0) * devices
        if claimed_at is not None and (last[tenant] is None or claimed_at > last[tenant]):  # type: ignore[operator]
            last[tenant] = claimed_at
    weights = settings.weights
    result = [TenantShare(t, usage[t], weights.get(t, 1.0), last[t], in_use[t], settings.device_limit(t))
              for t in waiting]
    return sorted(result, key=lambda s: s.key(settings.fair_share_quantum_s))


def _within_tenant(tenant: str, devices: int | None = None) -> ColumnElement[bool]:
    condition = and_(Job.tenant_id == tenant, Job.status == JobStatus.QUEUED)
    return condition if devices is None else and_(condition, Job.devices == devices)


def claim_next(session: Session, settings: Settings, *, device: str, now: datetime, devices: int = 1) -> Job | None:
    """Move the queued job on `devices` devices whose turn it is to running (attempt + 1) and return it; None if
    none may run now. Messages and jobs of one size match one for one, so a message never wakes a worker that
    cannot run the job it stands for."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_advisory_xact_lock(SCHEDULER_LOCK)))
    for share in shares(session, settings, now=now):
        if share.blocks(devices):
            continue
        # The tenant's next jobs locked FOR NO KEY UPDATE (key_share: the lock the claim's UPDATE takes anyway), waiting
        # for, never skipping, a row another transaction holds: the relay stamps a job's task id as it sends its
        # message, and an outbox or event insert references the row; skipping such a row passed over the tenant's
        # oldest job while broker recovery re-enqueued every queued job. Claims wait on each other only through
        # the advisory lock above, so the wait is as short as the transaction holding the row.
        candidates = (select(Job.id, Job.attempts).where(_within_tenant(share.tenant, devices))
                      .order_by(*states.QUEUE_ORDER).limit(4).with_for_update(key_share=True))
        for job_id, attempt in session.execute(candidates).tuples().all():
            job = states.claim(session, job_id=job_id, attempt=attempt, device=device, now=now,
                               when=Job.status.in_(states.sources(JobStatus.RUNNING)))
            if job is not None:
                return job
    return None


def ahead_in_tenant(session: Session, job: Job) -> int:
    """Queued jobs of the same tenant that run before `job` (higher priority, or older at the same priority)."""
    earlier = or_(Job.priority > job.priority,
                  and_(Job.priority == job.priority,
                       or_(Job.created_at < job.created_at, and_(Job.created_at == job.created_at, Job.id < job.id))))
    query = select(func.count()).select_from(Job).where(_within_tenant(job.tenant_id, job.devices), earlier)
    return int(session.scalar(query) or 0)


def place(session: Session, settings: Settings, job: Job, *, now: datetime) -> tuple[int, str] | None:
    """A queued job's position (1: runs next) and why it waits, if tenants keep taking turns; None if not queued.

    Others' jobs ahead: each tenant whose turn comes first contributes up to one more job per round than
    those after it, and tenants at their device limit contribute none until a device frees.
    """
    if job.status != JobStatus.QUEUED:
        return None
    standing = shares(session, settings, now=now)
    per_tenant = (select(Job.tenant_id, func.count()).where(Job.status == JobStatus.QUEUED, Job.devices == job.devices)
                  .group_by(Job.tenant_id))
    counts = {tenant: int(n) for tenant, n in session.execute(per_tenant).tuples()}
    own = ahead_in_tenant(session, job)
    order = [s.tenant for s in standing]
    mine = next((s for s in standing if s.tenant == job.tenant_id), None)
    if mine is None:  # the job left the queue (a worker claimed it) between reading the row and the standings
        return None
    others = 0
    for share in standing:
        if share.tenant == job.tenant_id or share.blocks(job.devices):
            continue
        turn_first = order.index(share.tenant) < order.index(job.tenant_id)
        others += min(int(counts.get(share.tenant, 0)), own + (1 if turn_first else 0))
    if mine.blocks(job.devices):
        reason = f"tenant at its device limit ({mine.in_use} of {mine.limit} devices in use)"
    elif own:
        reason = f"behind {own} job{'s' if own != 1 else ''} of your team"
        if others:
            reason += f" and {others} of other teams taking turns"
    elif others:
        reason = f"behind {others} job{'s' if others != 1 else ''} of teams whose turn comes first"
    else:
        reason = "next in line; waiting for a free worker"
    return 1 + own + others, reason
