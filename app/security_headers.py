"""Security headers on every response (API, dashboard, errors alike): no framing, no sniffing, no inline script."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The dashboard loads its scripts and styles from /ui/ only and builds the page with DOM calls: no inline
# <script>, no on* attributes, no style attributes (dom.js sets styles through the CSSOM, which CSP allows).
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
# FastAPI's interactive docs are one inline script plus Swagger UI / ReDoc from a CDN: only those pages get it.
DOCS_CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net; "
            "style-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net https://fonts.googleapis.com; "
            "font-src 'self' https://fonts.gstatic.com; img-src 'self' data: https://fastapi.tiangolo.com "
            "https://cdn.redoc.ly; worker-src 'self' blob:; object-src 'none'; base-uri 'none'; "
            "frame-ancestors 'none'")
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc"})


def security_headers(path: str) -> list[tuple[bytes, bytes]]:
    """The headers every response carries; the docs pages get their own content policy."""
    policy = DOCS_CSP if path in DOCS_PATHS else CSP
    return [(b"content-security-policy", policy.encode()), (b"x-content-type-options", b"nosniff"),
            (b"x-frame-options", b"DENY"), (b"referrer-policy", b"no-referrer")]


class SecurityHeadersMiddleware:
    """Adds the security headers to every HTTP response that does not already set them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = security_headers(scope["path"].removeprefix(scope.get("root_path", "")))

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                message["headers"] = [*message.get("headers", []), *(h for h in extra if h[0] not in present)]
            await send(message)

        await self.app(scope, receive, with_headers)
