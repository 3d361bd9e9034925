"""Prometheus scrape endpoint (unauthenticated unless TRAINSERVE_METRICS_REQUIRE_KEY is set)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from app.deps import SessionDep, SettingsDep
from app.services.metrics import broker_families, job_families, render
from core.auth import Unauthorized, authenticate

router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request, session: SessionDep, settings: SettingsDep) -> Response:
    """The API's request families, job states and queue depth, in Prometheus's text format."""
    if settings.metrics_require_key:
        principal = await run_in_threadpool(authenticate, session,
                                            authorization=request.headers.get("authorization"))
        if not principal.is_admin:
            raise Unauthorized("/metrics needs an admin key", field="authorization")
    families = await run_in_threadpool(job_families, session)
    families += await broker_families(request.app.state.redis)
    body = render(request.app.state.metrics_registry, families)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
