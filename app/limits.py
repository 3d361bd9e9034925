"""Request body limits, enforced before a route reads the body."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import envelope
from core.settings import Settings


class BodyLimitMiddleware:
    """413 for bodies over the limit: multipart uploads get the upload limit, everything else the JSON limit."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        multipart = headers.get(b"content-type", b"").startswith(b"multipart/")
        # Multipart framing adds a little to the file itself; allow 64 KiB for it.
        limit = self.settings.max_upload_bytes + 65536 if multipart else self.settings.max_request_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
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


async def _too_large(send: Send, limit: int) -> None:
    body = json.dumps(envelope("payload_too_large", f"request body is larger than {limit} bytes")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
