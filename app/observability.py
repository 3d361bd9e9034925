"""Every request gets an id (the client's `X-Request-ID` or a new one) bound for its log lines and returned in
the response, and is counted and timed by route template, so the metrics' label values stay few."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.logs import accept_request_id, request_id_var

REQUEST_ID = "x-request-id"
UNMATCHED = "<unmatched>"  # 404s for made-up paths share one label value instead of one each
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class HttpMetrics:
    """The API's request families, in the app's own registry (several apps may live in one test process)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("trainserve_http_requests", "HTTP requests by method, route template and status",
                                ["method", "route", "status"], registry=registry)
        self.latency = Histogram("trainserve_http_request_duration_seconds", "Time to the end of the response "
                                 "(streams included) by method and route template", ["method", "route"],
                                 buckets=_LATENCY_BUCKETS, registry=registry)
        self.rejected = Counter("trainserve_http_rate_limited", "429 answers (rate limits, quotas, full queues) "
                                "by route template", ["route"], registry=registry)


class ObservabilityMiddleware:
    """Pure ASGI (no buffering of streamed responses): binds the request id, sets the header, counts and times."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), None)
        request_id = accept_request_id(given)
        token = request_id_var.set(request_id)
        status = 500  # what the client gets if the app raises before starting a response
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = _route_template(scope)
            method = scope.get("method", "GET")
            self.metrics.requests.labels(method, route, str(status)).inc()
            self.metrics.latency.labels(method, route).observe(time.perf_counter() - started)
            if status == 429:
                self.metrics.rejected.labels(route).inc()
            request_id_var.reset(token)


def _route_template(scope: Scope) -> str:
    """The matched route's path template (`/jobs/{job_id}`), never the raw path."""
    route: Any = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else UNMATCHED
