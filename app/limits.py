"""Request body limits and the bound on concurrent uploads, enforced before a route reads the body."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import domain_headers, envelope, respond, status_for
from app.redis_window import take
from core.auth import authenticate, refuse_query_credentials
from core.errors import DomainError, TooManyRequests
from core.protocol import ErrorCode
from core.redis_keys import uploads_key
from core.settings import Settings

log = logging.getLogger(__name__)
# How long parsing an upload may take after its body arrived, beyond TRAINSERVE_BODY_TIMEOUT_S (a slot older than
# both is a crashed process's leftover).
UPLOAD_PARSE_S = 600.0

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
        timed_out = body_done = False
        pace = BodyPace(self.settings)

        async def limited_receive() -> Message:
            nonlocal received, too_large, timed_out, body_done
            if timed_out:
                return {"type": "http.disconnect"}
            if body_done:  # after the body, receive waits for a disconnect (streams listen for it): no pace
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout=pace.wait_s(received))
            except TimeoutError:
                # Too slow (a trickle, a stall): answer now and let the app see the client gone; the server
                # closes the connection, since the rest of the body was never read.
                timed_out = True
                await _send_error(send, 408, ErrorCode.REQUEST_TIMEOUT, pace.why(received), [(b"connection", b"close")])
                return {"type": "http.disconnect"}
            received += len(message.get("body", b""))
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            if received > limit:  # a chunked body without Content-Length: stop reading it here
                too_large = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def guarded_send(message: Message) -> None:
            # The app saw a truncated body and answers something; the client gets the 413 instead.
            if timed_out:
                return
            if not too_large:
                await send(message)
            elif message["type"] == "http.response.start":
                await _too_large(send, limit)

        await self.app(scope, limited_receive, guarded_send)


class BodyPace:
    """How long the next piece of a request body may take: the whole body within TRAINSERVE_BODY_TIMEOUT_S, and
    after TRAINSERVE_BODY_GRACE_S at least TRAINSERVE_MIN_BODY_RATE_BYTES per second on average (a client sending a
    byte every 25 seconds holds a connection, and an upload slot, for nothing)."""

    def __init__(self, settings: Settings, now: float | None = None) -> None:
        self.settings = settings
        self.started = time.monotonic() if now is None else now

    def wait_s(self, received: int, now: float | None = None) -> float:
        """Seconds to wait for more of the body, having `received` bytes (at least a moment, so it can fail)."""
        settings = self.settings
        allowed = settings.body_timeout_s
        if settings.min_body_rate_bytes:
            allowed = min(allowed, settings.body_grace_s + received / settings.min_body_rate_bytes)
        return max(self.started + allowed - (time.monotonic() if now is None else now), 0.001)

    def why(self, received: int) -> str:
        """The 408's message."""
        elapsed = time.monotonic() - self.started
        return (f"the request body came too slowly ({received} bytes in {elapsed:.0f} s; at least "
                f"{self.settings.min_body_rate_bytes} bytes per second after {self.settings.body_grace_s:g} s, and all "
                f"of it within {self.settings.body_timeout_s:g} s)")


class UploadSlotsMiddleware:
    """Uploads in progress, bounded per tenant across API processes and per process; 429 too_many_uploads beyond.

    The caller's key is checked first (401 before a byte of the body is read), then the tenant takes a slot in a
    Redis window (TRAINSERVE_UPLOADS_PER_TENANT; a Redis outage leaves only the process bound) and the process one
    of its TRAINSERVE_MAX_CONCURRENT_UPLOADS. Both are given back when the response is done or the client goes
    away: the framework spools the multipart body to disk while parsing the form, so the slot covers all of it.
    """

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.in_flight = 0  # one event loop per process: a plain counter is race-free between awaits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_upload(scope):
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        try:
            tenant = await _tenant(request)
            limit = self.settings.max_concurrent_uploads
            if self.in_flight >= limit:
                raise TooManyRequests(f"{self.in_flight} uploads are in progress in this API process; the limit is "
                                      f"{limit}; retry shortly", retry_after=5, code=ErrorCode.TOO_MANY_UPLOADS)
            member = await self._take(request, tenant)
        except DomainError as exc:
            await respond(request, status_for(exc), exc.envelope(), domain_headers(exc))(scope, receive, send)
            return
        self.in_flight += 1
        held = True

        async def release() -> None:
            nonlocal held
            if held:
                held = False
                self.in_flight -= 1
                if member is not None:
                    await asyncio.shield(_give_back(request, tenant, member))

        async def releasing_send(message: Message) -> None:
            # Given back as the last byte of the response goes out, not when the app returns afterwards:
            # a client that uploads again right after reading the answer must find its slot free.
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                await release()
            await send(message)

        try:
            await self.app(scope, receive, releasing_send)
        finally:
            await release()

    async def _take(self, request: Request, tenant: str | None) -> str | None:
        """The tenant's slot (its member in the Redis window), None when there is no tenant or no Redis."""
        redis = getattr(request.app.state, "redis", None)
        if tenant is None or redis is None:
            return None
        member = uuid.uuid4().hex
        # Entries older than the longest an upload may take are leftovers of a crashed API process.
        horizon = self.settings.body_timeout_s + UPLOAD_PARSE_S
        per_tenant = self.settings.uploads_per_tenant
        try:
            taken = await take(redis, uploads_key(tenant), member=member, now=time.time(), horizon=horizon,
                               limit=per_tenant)
        except RedisError:
            log.warning("redis unavailable: uploads bounded per API process only")
            return None
        if taken is not None:
            raise TooManyRequests(f"{per_tenant} uploads of this tenant are in progress; retry when one ends",
                                  retry_after=5, code=ErrorCode.TOO_MANY_UPLOADS)
        return member


async def _tenant(request: Request) -> str | None:
    """The caller's tenant (Unauthorized for a bad key, as the route would answer); None when the database is
    unreachable (the route answers that)."""
    factory = getattr(request.app.state, "sessionmaker", None)
    if factory is None:
        return None

    def lookup() -> str:
        refuse_query_credentials(request.query_params.multi_items())
        with factory() as session:
            return authenticate(session, authorization=request.headers.get("authorization")).tenant_id

    try:
        return await run_in_threadpool(lookup)
    except SQLAlchemyError:
        return None


async def _give_back(request: Request, tenant: str | None, member: str) -> None:
    try:
        await request.app.state.redis.zrem(uploads_key(tenant or ""), member)
    except RedisError:
        pass  # the entry ages out of the window (see _take)


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


# The answers that count as a refusal of what the client sent (not 403/404/409/429: those are about state).
REFUSED_STATUSES = frozenset({400, 401, 413, 422})
# Callers whose buckets one API process keeps; the least recently refused go first (a forgotten caller starts full).
REFUSAL_CALLERS_KEPT = 10_000


class RefusalBudget:
    """A token bucket of refusals per caller: TRAINSERVE_REFUSAL_BURST, refilled at TRAINSERVE_REFUSALS_PER_SECOND."""

    def __init__(self, per_second: float, burst: int, clock: Any = time.monotonic) -> None:
        self.per_second = per_second
        self.burst = float(burst)
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # caller -> (tokens, when counted)

    def _tokens(self, caller: str, now: float) -> float:
        tokens, when = self._buckets.get(caller, (self.burst, now))
        return min(self.burst, tokens + (now - when) * self.per_second)

    def wait_s(self, caller: str) -> float:
        """0 when `caller` may be answered; else the seconds until it has a refusal to spend again."""
        if caller not in self._buckets:
            return 0.0
        tokens = self._tokens(caller, self.clock())
        return 0.0 if tokens >= 1 else (1 - tokens) / self.per_second

    def refused(self, caller: str) -> None:
        """Spend one of `caller`'s refusals."""
        now = self.clock()
        self._buckets[caller] = (self._tokens(caller, now) - 1, now)
        self._buckets.move_to_end(caller)
        while len(self._buckets) > REFUSAL_CALLERS_KEPT:
            self._buckets.popitem(last=False)


# Set in a request's state by the key check that accepted its key (mark_key_accepted).
KEY_ACCEPTED = "refusal_budget_key_accepted"


def mark_key_accepted(scope: Scope) -> None:
    """Tell the refusal budget this request's key is a real one (the address's budget then does not hold it)."""
    scope.setdefault("state", {})[KEY_ACCEPTED] = True


class RefusalBudgetMiddleware:
    """429 too_many_refusals, before the body is parsed or the key looked up, for a caller whose requests have been
    refused past its budget (RefusalBudget). A caller is its credential (a digest of the Authorization header) and its
    client address: every refusal spends the credential's bucket, and a 401 (no key, a made-up or revoked one) the
    address's too, so rotating invented keys from one address spends one budget. A key this process has accepted
    passes while its address's budget is spent (it is not the one being refused); any other key from that address,
    and a request without one, is refused with it. The body of a request answered so is drained unparsed, so the
    client reads the 429."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.budget = RefusalBudget(settings.refusals_per_second, settings.refusal_burst)
        self.accepted: OrderedDict[str, None] = OrderedDict()  # credentials whose key check passed, newest last

    def _wait_s(self, credential: str | None, address: str) -> float:
        own = self.budget.wait_s(credential) if credential is not None else 0.0
        if credential in self.accepted:
            return own
        return max(own, self.budget.wait_s(address))

    def _answered(self, credential: str | None, address: str, status: int, state: dict[str, Any]) -> None:
        if credential is not None and state.get(KEY_ACCEPTED):
            self.accepted[credential] = None
            self.accepted.move_to_end(credential)
            while len(self.accepted) > REFUSAL_CALLERS_KEPT:
                self.accepted.popitem(last=False)
        if status not in REFUSED_STATUSES:
            return
        if credential is not None:
            self.budget.refused(credential)
        if credential is None or status == 401:
            self.accepted.pop(credential or "", None)  # a revoked key is a stranger again
            self.budget.refused(address)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        credential, address = _credential(scope), _address(scope)
        state = scope.setdefault("state", {})  # where the key's check marks it accepted (mark_key_accepted)
        wait = self._wait_s(credential, address)
        if wait > 0:
            drained = await _drain(receive, self.settings.max_request_bytes, self.settings.body_grace_s)
            retry = max(1, math.ceil(wait))
            headers = [(b"retry-after", str(retry).encode()), *([] if drained else [(b"connection", b"close")])]
            await _send_error(send, 429, ErrorCode.TOO_MANY_REFUSALS,
                              "too many of this caller's requests were refused (malformed, over a bound, or "
                              f"unauthorized); retry in {retry} s", headers)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._answered(credential, address, message["status"], state)
            await send(message)

        await self.app(scope, receive, counting_send)


def _credential(scope: Scope) -> str | None:
    """The caller's credential as a digest of its Authorization header; None without one."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return "key:" + hashlib.sha256(value).hexdigest()
    return None


def _address(scope: Scope) -> str:
    client = scope.get("client")
    return f"address:{client[0] if client else ''}"


async def _drain(receive: Receive, most_bytes: int, most_s: float) -> bool:
    """Read and drop a request body (a client still sending would lose an answer closed on it): at most `most_bytes`
    within `most_s`; False when it stopped short (the connection is then closed)."""
    received = 0
    deadline = time.monotonic() + most_s
    while received <= most_bytes:
        try:
            message = await asyncio.wait_for(receive(), timeout=max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            return False
        received += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            return True
    return False
