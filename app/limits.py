"""Request body limits and the bound on concurrent uploads, enforced before a route reads the body."""

from __future__ import annotations

import json
import threading
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import envelope
from core.errors import TooManyRequests
from core.protocol import ErrorCode
from core.settings import Settings

# The routes that take a file (/v1/files is OpenAI's name for a dataset upload). Everything else takes JSON,
# whatever Content-Type a client claims: a body labelled multipart/... elsewhere gets the JSON limit.
UPLOAD_ROUTES = frozenset({("POST", "/datasets"), ("POST", "/v1/files")})


def is_upload(scope: Scope) -> bool:
    """True for a request to a route that accepts a file upload."""
    path = scope["path"].removeprefix(scope.get("root_path", "")).rstrip("/") or "/"
    return (scope["method"], path) in UPLOAD_ROUTES


class BodyLimitMiddleware:
    """413 for bodies over the limit: upload routes get the upload limit, everything else the JSON limit."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        # Multipart framing adds a little to the file itself; allow 64 KiB for it.
        limit = self.settings.max_upload_bytes + 65536 if is_upload(scope) else self.settings.max_request_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and (len(length) > 18 or int(length) > limit):
            await _too_large(send, limit)
            return
        received = 0
        too_large = False

        async def limited_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # a chunked body without Content-Length: stop reading it here
                too_large = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def guarded_send(message: Message) -> None:
            # The app saw a truncated body and answers something; the client gets the 413 instead.
            if not too_large:
                await send(message)
            elif message["type"] == "http.response.start":
                await _too_large(send, limit)

        await self.app(scope, limited_receive, guarded_send)


class UploadSlotsMiddleware:
    """At most `max_concurrent_uploads` uploads received and parsed at once per process; 429 beyond.

    The slot is taken before the multipart body is read (the framework spools it to disk while parsing the
    form) and given back when the response is done or the client goes away.
    """

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.in_flight = 0  # one event loop per process: a plain counter is race-free between awaits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_upload(scope):
            await self.app(scope, receive, send)
            return
        limit = self.settings.max_concurrent_uploads
        if self.in_flight >= limit:
            await _send_error(send, 429, ErrorCode.TOO_MANY_UPLOADS,
                              f"{self.in_flight} uploads are in progress; the limit is {limit}; retry shortly",
                              [(b"retry-after", b"5")])
            return
        self.in_flight += 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.in_flight -= 1

        async def releasing_send(message: Message) -> None:
            # Given back as the last byte of the response goes out, not when the app returns afterwards:
            # a client that uploads again right after reading the answer must find its slot free.
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                release()
            await send(message)

        try:
            await self.app(scope, receive, releasing_send)
        finally:
            release()


class TenantSlots:
    """Long responses (event streams, downloads) a tenant may hold open at once in one API process; 429 beyond,
    so no tenant's slow readers can use up the process's capacity for everyone."""

    def __init__(self, per_tenant: int, *, code: str, what: str) -> None:
        self.per_tenant = per_tenant
        self.code = code
        self.what = what  # e.g. "event streams are already open"
        self.open: dict[str, int] = {}
        self.lock = threading.Lock()  # downloads take a slot in a request thread, streams on the event loop

    def check(self, tenant: str) -> None:
        """Raise 429 (this kind's code) when the tenant has no slot left."""
        if self.open.get(tenant, 0) >= self.per_tenant:
            raise TooManyRequests(f"{self.per_tenant} {self.what} for this tenant; retry when one ends",
                                  retry_after=5, code=self.code)

    def acquire(self, tenant: str) -> None:
        """Take a slot or raise 429."""
        with self.lock:
            self.check(tenant)
            self.open[tenant] = self.open.get(tenant, 0) + 1

    def release(self, tenant: str) -> None:
        """Give a slot back."""
        with self.lock:
            left = self.open.get(tenant, 0) - 1
            if left > 0:
                self.open[tenant] = left
            else:
                self.open.pop(tenant, None)


async def _too_large(send: Send, limit: int) -> None:
    await _send_error(send, 413, ErrorCode.PAYLOAD_TOO_LARGE, f"request body is larger than {limit} bytes")


async def _send_error(send: Send, status: int, code: str, message: str,
                      extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(envelope(code, message)).encode()
    headers: list[Any] = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                          *(extra_headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
