"""Webhook routes: register, list, read, delete, rotate the secret, delivery log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from starlette.concurrency import run_in_threadpool

from app.deps import PrincipalDep, SessionDep, SettingsDep
from app.errors import ERROR_RESPONSES
from app.schemas.jobs import INT32_MAX
from app.schemas.webhooks import DeliveryPage, RotateSecret, WebhookCreate, WebhookRead
from app.services import webhooks as service
from core.store import webhooks as store

router = APIRouter(prefix="/webhooks", tags=["webhooks"], responses=ERROR_RESPONSES)


@router.post("", status_code=201, response_model=WebhookRead)
async def create_webhook(spec: WebhookCreate, session: SessionDep, settings: SettingsDep, principal: PrincipalDep
                         ) -> WebhookRead:
    """Register an endpoint for some event types; the answer carries its signing secret (shown once)."""
    await service.check_url(settings, spec.url)  # DNS: no database connection is held while it answers
    endpoint = await run_in_threadpool(service.create_endpoint, session, settings, principal, spec=spec)
    return service.webhook_read(endpoint, with_secret=True)


@router.get("", response_model=list[WebhookRead])
def list_webhooks(session: SessionDep, principal: PrincipalDep) -> list[WebhookRead]:
    """The tenant's endpoints (at most 20), oldest first."""
    return [service.webhook_read(e) for e in store.list_endpoints(session, tenant=principal.scope)]


@router.get("/{endpoint_id}", response_model=WebhookRead)
def get_webhook(endpoint_id: str, session: SessionDep, principal: PrincipalDep) -> WebhookRead:
    """One endpoint (without its secret)."""
    return service.webhook_read(store.get_endpoint(session, endpoint_id=endpoint_id, tenant=principal.scope))


@router.delete("/{endpoint_id}", status_code=204, response_class=Response)
def delete_webhook(endpoint_id: str, session: SessionDep, principal: PrincipalDep) -> Response:
    """Stop sending to an endpoint; its pending deliveries are dropped."""
    service.delete_endpoint(session, principal, endpoint_id=endpoint_id)
    return Response(status_code=204)


@router.post("/{endpoint_id}/rotate-secret", response_model=WebhookRead)
def rotate_secret(endpoint_id: str, session: SessionDep, settings: SettingsDep, principal: PrincipalDep,
                  body: RotateSecret | None = None) -> WebhookRead:
    """A new secret (returned once); the old one also signs deliveries for the grace period."""
    endpoint = service.rotate_secret(session, settings, principal, endpoint_id=endpoint_id,
                                     grace_seconds=body.grace_seconds if body else None)
    return service.webhook_read(endpoint, with_secret=True)


@router.get("/{endpoint_id}/deliveries", response_model=DeliveryPage)
def list_deliveries(endpoint_id: str, session: SessionDep, principal: PrincipalDep,
                    limit: Annotated[int, Query(ge=1, le=100)] = 20,
                    before: Annotated[int | None, Query(ge=1, le=INT32_MAX)] = None) -> DeliveryPage:
    """Deliveries, newest first: status, attempts with status code, response start, error and timing."""
    return service.deliveries(session, principal, endpoint_id=endpoint_id, limit=limit, before=before)
