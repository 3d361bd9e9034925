"""Webhook endpoints: register (URL checked), list, delete, rotate the secret, read the delivery log."""

from __future__ import annotations

import base64
import secrets
from datetime import timedelta

from sqlalchemy.orm import Session

from app.schemas.webhooks import AttemptRead, DeliveryPage, DeliveryRead, WebhookCreate, WebhookRead
from core.auth import Principal
from core.errors import TooManyRequests
from core.rows import WebhookEndpoint, utcnow
from core.netguard import resolve, split_url
from core.protocol import ErrorCode
from core.settings import Settings
from core.store import webhooks as store

MAX_ENDPOINTS = 20  # per tenant: every event fans out to each, so the number is bounded


def new_secret() -> str:
    """A Standard Webhooks secret: whsec_ and 32 random bytes in base64."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def create_endpoint(session: Session, settings: Settings, principal: Principal, *, spec: WebhookCreate
                    ) -> WebhookEndpoint:
    """Check the URL resolves to public addresses (unless allowed), store the endpoint with a fresh secret."""
    _, host, port = split_url(spec.url)
    resolve(host, port, allow_private=settings.webhook_allow_private)
    if store.count_endpoints(session, tenant=principal.tenant_id) >= MAX_ENDPOINTS:
        raise TooManyRequests(f"a tenant may register at most {MAX_ENDPOINTS} webhook endpoints",
                              code=ErrorCode.QUOTA_EXCEEDED)
    endpoint = store.add_endpoint(session, tenant_id=principal.tenant_id, url=spec.url,
                                  event_types=sorted(set(spec.event_types)), description=spec.description,
                                  secret=new_secret())
    session.commit()
    return endpoint


def rotate_secret(session: Session, settings: Settings, principal: Principal, *, endpoint_id: str,
                  grace_seconds: float | None) -> WebhookEndpoint:
    """A new secret; the old one keeps signing for the grace period, so receivers can switch without a gap."""
    endpoint = store.get_endpoint(session, endpoint_id=endpoint_id, tenant=principal.scope)
    grace = settings.webhook_secret_grace_s if grace_seconds is None else grace_seconds
    endpoint.previous_secret = endpoint.secret if grace > 0 else None
    endpoint.previous_secret_until = utcnow() + timedelta(seconds=grace) if grace > 0 else None
    endpoint.secret = new_secret()
    session.commit()
    return endpoint


def delete_endpoint(session: Session, principal: Principal, *, endpoint_id: str) -> None:
    """Delete an endpoint and its pending deliveries."""
    session.delete(store.get_endpoint(session, endpoint_id=endpoint_id, tenant=principal.scope))
    session.commit()


def webhook_read(endpoint: WebhookEndpoint, *, with_secret: bool = False) -> WebhookRead:
    """The public endpoint object; the secret only right after it was made."""
    read = WebhookRead.model_validate(endpoint)
    read.secret = endpoint.secret if with_secret else None
    return read


def deliveries(session: Session, principal: Principal, *, endpoint_id: str, limit: int, before: int | None
               ) -> DeliveryPage:
    """An endpoint's deliveries, newest first, each with every attempt."""
    store.get_endpoint(session, endpoint_id=endpoint_id, tenant=principal.scope)
    rows = store.list_deliveries(session, endpoint_id=endpoint_id, limit=limit + 1, before_id=before)
    page = [DeliveryRead(id=d.id, event_id=d.event_id, event_type=d.event.type, status=d.status,
                         attempts=d.attempts, next_attempt_at=d.next_attempt_at if d.status == "pending" else None,
                         created_at=d.created_at, finished_at=d.finished_at,
                         attempt_log=[AttemptRead.model_validate(a) for a in d.attempt_log]) for d in rows[:limit]]
    return DeliveryPage(data=page, next_before=page[-1].id if len(rows) > limit else None)
