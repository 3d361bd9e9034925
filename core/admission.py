"""Per-tenant admission: the one check every place that makes jobs or webhook endpoints goes through.

POST /jobs, reruns, sweeps and their children (core/sweeps.advance) and POST /webhooks each take the
tenant's admission lock, count, and insert in one transaction, so concurrent requests cannot all see
room for one more (count, then insert, lets 60 concurrent registrations past a cap of 20). On PostgreSQL the
lock is a transaction-scoped advisory lock per tenant; on SQLite any write takes the database's single
write lock until commit, and the count that follows it reads the latest state. The lock is taken last, right
before the insert, and held only until the caller commits: slow checks (datasets, model configs, DNS) come
before it.
"""

from __future__ import annotations

import zlib

from sqlalchemy import false, func, select, update
from sqlalchemy.orm import Session

from core.errors import TooManyRequests
from core.protocol import ErrorCode
from core.rows import ACTIVE, ApiKey
from core.settings import Settings
from core.store import jobs as job_store
from core.store import webhooks as webhook_store

# High 32 bits of the advisory lock key; the scheduler's key (core/job_order.py) is below 2**32, so none collide.
LOCK_SPACE = 0x7453_4144


def lock_tenant(session: Session, *, tenant_id: str) -> None:
    """Serialise admissions of `tenant_id` until the session's transaction ends."""
    if session.get_bind().dialect.name == "postgresql":
        key = (LOCK_SPACE << 32) | zlib.crc32(tenant_id.encode())
        session.execute(select(func.pg_advisory_xact_lock(key)))
    else:  # SQLite: an UPDATE that matches nothing still takes the write lock, and waits for it (busy_timeout)
        session.execute(update(ApiKey).where(false()).values(name=ApiKey.name)
                        .execution_options(synchronize_session=False))


def job_room(session: Session, settings: Settings, *, tenant_id: str) -> tuple[int, int]:
    """Lock the tenant and return (jobs it may still add, its active jobs) under its job limit."""
    lock_tenant(session, tenant_id=tenant_id)
    active = job_store.count_jobs(session, tenant=tenant_id, statuses=sorted(ACTIVE))
    return max(settings.max_active_jobs_per_tenant - active, 0), active


def admit_jobs(session: Session, settings: Settings, *, tenant_id: str, adding: int = 1) -> None:
    """Lock the tenant, then 429 quota_exceeded if `adding` more active jobs would pass its limit; the caller
    inserts them and commits (which releases the lock)."""
    room, active = job_room(session, settings, tenant_id=tenant_id)
    if adding > room:
        raise TooManyRequests(f"{active} jobs are queued or running; the limit per tenant is "
                              f"{settings.max_active_jobs_per_tenant}", retry_after=30,
                              code=ErrorCode.QUOTA_EXCEEDED)


def admit_endpoint(session: Session, settings: Settings, *, tenant_id: str) -> None:
    """Lock the tenant, then 429 quota_exceeded if it already has its webhook endpoint limit."""
    lock_tenant(session, tenant_id=tenant_id)
    if webhook_store.count_endpoints(session, tenant=tenant_id) >= settings.max_webhook_endpoints:
        raise TooManyRequests(f"a tenant may register at most {settings.max_webhook_endpoints} webhook endpoints",
                              code=ErrorCode.QUOTA_EXCEEDED)


def waiting_reason(active: int, settings: Settings) -> str:
    """Why a sweep creates no child now although it has trials left."""
    return (f"tenant at its job limit ({active} of {settings.max_active_jobs_per_tenant} jobs queued or running); "
            "the next trial starts when one ends")
