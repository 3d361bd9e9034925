"""The webhook sender: deliver due outbox rows, signed per Standard Webhooks, with bounded time and concurrency.

Every round (a Periodic thread in each training worker) leases due deliveries with a conditional UPDATE and
hands them to a thread pool: at most `webhook_concurrency` in flight, at most `webhook_per_endpoint` per
endpoint, each attempt bounded by `webhook_timeout_s`, so one slow endpoint cannot hold the others up.
A 2xx delivers; anything else is logged as an attempt and retried with doubling delays until
`webhook_retry_for_s` after the event, always with the same webhook-id (the event's id).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta

import httpx
from sqlalchemy.orm import Session, sessionmaker
from standardwebhooks import Webhook

from core.db import session_scope
from core.rows import WebhookEndpoint, utcnow
from core.netguard import UnsafeAddress, resolve, split_url
from core.periodic import Periodic
from core.settings import Settings
from core.store import webhooks as store

log = logging.getLogger(__name__)

READ_LIMIT = 4096  # bytes of a response read (1000 characters are kept)
PRUNE_EVERY = 600  # rounds between deletions of finished events older than a week


@dataclass(frozen=True)
class Attempt:
    """What one delivery attempt needs, read from the database before the pool thread starts."""

    delivery_id: int
    endpoint_id: str
    url: str
    secrets: tuple[str, ...]
    event_id: str
    payload: str
    event_created: datetime
    attempts: int


def sign(secrets: tuple[str, ...], event_id: str, when: datetime, payload: str) -> dict[str, str]:
    """The three Standard Webhooks headers; one signature per secret (the old one too during a rotation)."""
    signatures = " ".join(Webhook(secret).sign(event_id, when, payload) for secret in secrets)
    return {"webhook-id": event_id, "webhook-timestamp": str(int(when.timestamp())),
            "webhook-signature": signatures, "content-type": "application/json"}


def active_secrets(endpoint: WebhookEndpoint, now: datetime) -> tuple[str, ...]:
    """The current secret, plus the previous one while its grace period lasts."""
    if endpoint.previous_secret and endpoint.previous_secret_until and endpoint.previous_secret_until > now:
        return endpoint.secret, endpoint.previous_secret
    return (endpoint.secret,)


def retry_at(settings: Settings, *, event_created: datetime, attempts: int, now: datetime) -> datetime | None:
    """When to try again after `attempts` failed tries; None once the event is older than the retry period."""
    if now - event_created >= timedelta(seconds=settings.webhook_retry_for_s):
        return None
    delay = min(settings.webhook_backoff_s * 2 ** max(attempts - 1, 0), settings.webhook_max_backoff_s)
    return now + timedelta(seconds=delay)


def post(settings: Settings, url: str, headers: dict[str, str], payload: str) -> tuple[int, str]:
    """POST to the URL's checked address (not a second DNS answer); returns status code and the body's start."""
    scheme, host, port = split_url(url)
    address = resolve(host, port, allow_private=settings.webhook_allow_private)[0]
    target = httpx.URL(url).copy_with(host=address)
    default_port = port == (443 if scheme == "https" else 80)
    headers = {**headers, "host": host if default_port else f"{host}:{port}"}
    extensions = {"sni_hostname": host} if scheme == "https" else {}
    # A fresh client per attempt: pooled connections are keyed by address, and TLS names must not mix.
    with httpx.Client(timeout=settings.webhook_timeout_s, follow_redirects=False, trust_env=False) as client:
        with client.stream("POST", target, content=payload.encode(), headers=headers,
                           extensions=extensions) as response:
            body = b""
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) >= READ_LIMIT:
                    break
            return response.status_code, body[:READ_LIMIT].decode("utf-8", "replace")


class WebhookSender:
    """Leases due deliveries and sends them from a bounded pool; `round()` is one pass."""

    def __init__(self, factory: sessionmaker[Session], settings: Settings) -> None:
        self.factory = factory
        self.settings = settings
        self.pool = ThreadPoolExecutor(settings.webhook_concurrency, thread_name_prefix="webhook")
        self.in_flight: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.rounds = 0

    def round(self) -> int:
        """Start every due delivery there is room for; returns how many started."""
        with self.lock:
            room = self.settings.webhook_concurrency - sum(self.in_flight.values())
            busy = {e for e, n in self.in_flight.items() if n >= self.settings.webhook_per_endpoint}
        self.rounds += 1
        if self.rounds % PRUNE_EVERY == 1:
            with session_scope(self.factory) as session:
                store.prune(session, before=utcnow() - store.KEEP_FINISHED)
        if room <= 0:
            return 0
        taken = self._lease(room, busy)
        for attempt in taken:
            self.pool.submit(self._send, attempt)
        return len(taken)

    def _lease(self, room: int, busy: set[str]) -> list[Attempt]:
        now = utcnow()
        # Long enough for one attempt; a sender that dies mid-attempt leaves the delivery due again after it.
        until = now + timedelta(seconds=self.settings.webhook_timeout_s * 3 + 30)
        taken: list[Attempt] = []
        per_endpoint = Counter(self.in_flight)
        with session_scope(self.factory) as session:
            for delivery in store.due(session, now=now, limit=room * 4, exclude=busy):
                if len(taken) >= room or per_endpoint[delivery.endpoint_id] >= self.settings.webhook_per_endpoint:
                    continue
                endpoint = session.get(WebhookEndpoint, delivery.endpoint_id)
                if endpoint is None or not store.lease(session, delivery=delivery, until=until):
                    continue
                per_endpoint[delivery.endpoint_id] += 1
                taken.append(Attempt(delivery.id, endpoint.id, endpoint.url, active_secrets(endpoint, now),
                                     delivery.event.id, delivery.event.payload, delivery.event.created_at,
                                     delivery.attempts))
        with self.lock:
            for attempt in taken:
                self.in_flight[attempt.endpoint_id] += 1
        return taken

    def _send(self, attempt: Attempt) -> None:
        started, clock = utcnow(), time.monotonic()
        status: int | None = None
        body = error = None
        try:
            headers = sign(attempt.secrets, attempt.event_id, started, attempt.payload)
            status, body = post(self.settings, attempt.url, headers, attempt.payload)
        except UnsafeAddress as exc:
            error = exc.message
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - whatever happened is this attempt's recorded outcome
            log.exception("webhook delivery %d failed unexpectedly", attempt.delivery_id)
            error = f"{type(exc).__name__}: {exc}"
        try:
            ok = status is not None and 200 <= status < 300
            again = None if ok else retry_at(self.settings, event_created=attempt.event_created,
                                             attempts=attempt.attempts + 1, now=utcnow())
            with session_scope(self.factory) as session:
                store.record_attempt(session, delivery_id=attempt.delivery_id, started=started,
                                     duration_ms=(time.monotonic() - clock) * 1000, status_code=status, body=body,
                                     error=error, retry_at=again)
        except Exception:  # noqa: BLE001 - database away: the lease expires and the delivery is tried again
            log.warning("could not record webhook attempt of delivery %d", attempt.delivery_id, exc_info=True)
        finally:
            with self.lock:
                self.in_flight[attempt.endpoint_id] -= 1

    def close(self) -> None:
        """Stop taking work and wait for attempts in flight (each bounded by the timeout)."""
        self.pool.shutdown(wait=True, cancel_futures=True)


def sender_thread(factory: sessionmaker[Session], settings: Settings) -> Periodic:
    """A daemon thread that runs the sender's rounds every `webhook_interval_s`."""
    # httpx logs every request at INFO: one line per retry of every delivery would drown the worker's log
    # (the attempts are in the database, GET /webhooks/{id}/deliveries).
    logging.getLogger("httpx").setLevel(logging.WARNING)
    sender = WebhookSender(factory, settings)
    return Periodic("webhook-sender", settings.webhook_interval_s, sender.round)
