"""Data access for webhooks: endpoints, the event outbox and its deliveries with every attempt.

`emit` is the one call that publishes an event: it writes the event and one delivery per subscribed endpoint
in the caller's transaction, so an event exists exactly when the state change that caused it committed.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session, selectinload

from core.rows import (
    DeliveryStatus,
    Job,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    WebhookEventType,
    new_id,
    utcnow,
)
from core.protocol import WebhookPayload
from core.store.owned import get_owned

MAX_BODY_CHARS = 1000  # of an endpoint's response, kept for GET /webhooks/{id}/deliveries


def emit(session: Session, *, tenant_id: str, type: WebhookEventType, data: dict[str, Any],
         now: datetime | None = None) -> WebhookEvent | None:
    """Publish an event to the tenant's endpoints that want it; None (nothing written) when none does."""
    endpoints = [e for e in session.scalars(select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id))
                 if type in e.event_types]
    if not endpoints:
        return None
    now = now or utcnow()
    event_id = new_id("msg")
    body = WebhookPayload(type=type, timestamp=now, data=data).model_dump_json()
    event = WebhookEvent(id=event_id, tenant_id=tenant_id, type=type, payload=body, created_at=now)
    session.add(event)
    session.flush()
    for endpoint in endpoints:
        session.add(WebhookDelivery(event_id=event_id, endpoint_id=endpoint.id, status=DeliveryStatus.PENDING,
                                    attempts=0, next_attempt_at=now, created_at=now))
    session.flush()
    return event


def job_data(job: Job, **extra: Any) -> dict[str, Any]:
    """The job summary an event carries (the full object is one GET /jobs/{id} away)."""
    return {"id": job.id, "object": "job", "status": job.status, "task": job.task, "step": job.step,
            "total_steps": job.total_steps, "attempts": job.attempts, "metrics": dict(job.metrics or {}),
            "error": job.error, "metadata": dict(job.metadata_ or {}), **extra}


def add_endpoint(session: Session, *, tenant_id: str, url: str, event_types: list[str], description: str,
                 secret: str) -> WebhookEndpoint:
    """Register an endpoint (the caller validated the URL)."""
    endpoint = WebhookEndpoint(id=new_id("whk"), tenant_id=tenant_id, url=url, event_types=event_types,
                               description=description, secret=secret, created_at=utcnow())
    session.add(endpoint)
    session.flush()
    return endpoint


def get_endpoint(session: Session, *, endpoint_id: str, tenant: str | None) -> WebhookEndpoint:
    """An endpoint visible to `tenant` (None: any) or NotFound."""
    return get_owned(session, WebhookEndpoint, endpoint_id, what="webhook endpoint", tenant=tenant)


def list_endpoints(session: Session, *, tenant: str | None) -> list[WebhookEndpoint]:
    """A tenant's endpoints, oldest first."""
    query = select(WebhookEndpoint).order_by(WebhookEndpoint.created_at, WebhookEndpoint.id)
    if tenant is not None:
        query = query.where(WebhookEndpoint.tenant_id == tenant)
    return list(session.scalars(query))


def count_endpoints(session: Session, *, tenant: str) -> int:
    """How many endpoints a tenant has."""
    return len(list_endpoints(session, tenant=tenant))


def list_deliveries(session: Session, *, endpoint_id: str, limit: int, before_id: int | None = None
                    ) -> list[WebhookDelivery]:
    """An endpoint's deliveries, newest first, with their event and attempts."""
    query = (select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint_id)
             .options(selectinload(WebhookDelivery.attempt_log), selectinload(WebhookDelivery.event))
             .order_by(WebhookDelivery.id.desc()).limit(limit))
    if before_id is not None:
        query = query.where(WebhookDelivery.id < before_id)
    return list(session.scalars(query))


def due(session: Session, *, now: datetime, limit: int, exclude: set[str]) -> list[WebhookDelivery]:
    """Pending deliveries whose next attempt is due, oldest first, skipping busy endpoints."""
    query = (select(WebhookDelivery).where(WebhookDelivery.status == DeliveryStatus.PENDING,
                                           WebhookDelivery.next_attempt_at <= now)
             .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id).limit(limit))
    if exclude:
        query = query.where(WebhookDelivery.endpoint_id.not_in(sorted(exclude)))
    return list(session.scalars(query))


def lease(session: Session, *, delivery: WebhookDelivery, until: datetime) -> bool:
    """Take a due delivery for one attempt by pushing its next attempt to `until`; False if another sender did.

    A conditional UPDATE on the value just read, so two senders (several workers, SQLite or PostgreSQL)
    never send the same delivery at once; a sender that dies mid-attempt leaves it due again at `until`.
    """
    result = session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id == delivery.id, WebhookDelivery.status == DeliveryStatus.PENDING,
               WebhookDelivery.next_attempt_at == delivery.next_attempt_at)
        .values(next_attempt_at=until).execution_options(synchronize_session=False))
    return bool(result.rowcount)  # type: ignore[attr-defined]


def record_attempt(session: Session, *, delivery_id: int, started: datetime, duration_ms: float,
                   status_code: int | None, body: str | None, error: str | None, retry_at: datetime | None) -> None:
    """Log an attempt and move the delivery on: delivered (2xx), due again at `retry_at`, or failed (None)."""
    session.add(WebhookAttempt(delivery_id=delivery_id, attempted_at=started, duration_ms=round(duration_ms, 1),
                               status_code=status_code, response_body=None if body is None else body[:MAX_BODY_CHARS],
                               error=None if error is None else error[:MAX_BODY_CHARS]))
    ok = status_code is not None and 200 <= status_code < 300
    values: dict[str, Any] = {"attempts": WebhookDelivery.attempts + 1}
    if ok:
        values.update(status=DeliveryStatus.DELIVERED, finished_at=utcnow())
    elif retry_at is None:
        values.update(status=DeliveryStatus.FAILED, finished_at=utcnow())
    else:
        values["next_attempt_at"] = retry_at
    session.execute(update(WebhookDelivery).where(WebhookDelivery.id == delivery_id).values(**values)
                    .execution_options(synchronize_session=False))


def prune(session: Session, *, before: datetime) -> int:
    """Delete events (with their deliveries) older than `before` whose deliveries all finished."""
    pending = select(WebhookDelivery.event_id).where(WebhookDelivery.status == DeliveryStatus.PENDING)
    result = session.execute(delete(WebhookEvent).where(WebhookEvent.created_at < before,
                                                        WebhookEvent.id.not_in(pending)))
    return int(result.rowcount)  # type: ignore[attr-defined]




KEEP_FINISHED = timedelta(days=7)  # finished deliveries stay this long for GET /webhooks/{id}/deliveries
