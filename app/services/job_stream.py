"""A job's live feed as server-sent events: state changes, metric points and events, resumable by event id.

    connect   check the job (tenant-scoped), take one of the tenant's stream slots, release the request's session
    poll      in a worker thread, one short session: the job row, then events and points after the cursor
    send      `state` when status/step/metrics change, `job_event` per event, `metrics` in batches;
              every message carries the cursor `<event id>-<point id>` as its SSE id
    idle      sleep on the event loop between polls (no connection, no thread held); `: ping` comments
    end       `end` once the job is terminal and drained, or when the client goes away; the slot is freed
Reading the job row before the tail means a terminal status is seen only after the writes that preceded it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from app.schemas.jobs import EventRead
from app.sse import COMPACT, sse_comment, sse_message, sse_retry
from core.errors import TooManyRequests, ValidationFailed
from core.rows import TERMINAL, JobStatus
from core.protocol import ErrorCode
from core.settings import Settings
from core.store import history
from core.store import jobs as store

EVENT_BATCH = 200  # events read per poll
POINT_BATCH = 2000  # metric points read per poll
POINTS_PER_MESSAGE = 500  # points per `metrics` message


@dataclass(frozen=True)
class Cursor:
    """Where a stream is: the last event id and the last metric point id it sent."""

    event_id: int = 0
    point_id: int = 0

    def __str__(self) -> str:
        return f"{self.event_id}-{self.point_id}"

    @classmethod
    def parse(cls, raw: str) -> Cursor:
        """Read a Last-Event-ID header; 422 naming the header when it is not one of ours."""
        parts = raw.strip().split("-")
        if len(parts) != 2 or not all(p.isdigit() and len(p) <= 10 for p in parts):
            raise ValidationFailed("Last-Event-ID", "must be '<event id>-<point id>' as sent in a stream's id field")
        return cls(int(parts[0]), int(parts[1]))


class StreamSlots:
    """Open streams per tenant, bounded so that no tenant's dashboards can use up the API's capacity."""

    def __init__(self, per_tenant: int) -> None:
        self.per_tenant = per_tenant
        self.open: dict[str, int] = {}

    def check(self, tenant: str) -> None:
        """Raise 429 too_many_streams when the tenant has no slot left (the route answers it before streaming)."""
        if self.open.get(tenant, 0) >= self.per_tenant:
            raise TooManyRequests(f"{self.per_tenant} event streams are already open for this tenant; close one "
                                  "or poll /jobs/{id}/events", retry_after=5, code=ErrorCode.TOO_MANY_STREAMS)

    def acquire(self, tenant: str) -> None:
        """Take a slot or raise 429 too_many_streams."""
        self.check(tenant)
        self.open[tenant] = self.open.get(tenant, 0) + 1

    def release(self, tenant: str) -> None:
        """Give a slot back."""
        left = self.open.get(tenant, 0) - 1
        if left > 0:
            self.open[tenant] = left
        else:
            self.open.pop(tenant, None)


@dataclass
class Poll:
    """What one poll read."""

    state: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)
    points: list[dict[str, Any]] = field(default_factory=list)
    cursor: Cursor = field(default_factory=Cursor)
    full: bool = False  # a batch limit was reached: poll again without waiting


def read_once(make_session: sessionmaker[Session], *, job_id: str, cursor: Cursor, since_step: int) -> Poll:
    """One short read: the job's state, then what was stored after `cursor` (runs in a worker thread)."""
    with make_session() as session:
        job = store.get_job(session, job_id=job_id)
        state = {"status": job.status, "step": job.step, "total_steps": job.total_steps, "epoch": job.epoch,
                 "eta_seconds": None if job.is_terminal else job.eta_seconds, "metrics": job.metrics or {},
                 "error": job.error, "attempts": job.attempts, "device": job.device}
        events = store.list_events(session, job_id=job_id, after_id=cursor.event_id, limit=EVENT_BATCH)
        points = history.points_after(session, job_id=job_id, after_id=cursor.point_id, since_step=since_step,
                                      limit=POINT_BATCH)
    return Poll(
        state=state,
        events=[EventRead.model_validate(e).model_dump(mode="json") for e in events],
        points=[{"id": p.id, "step": p.step, "epoch": p.epoch, "name": p.name, "value": p.value,
                 "created_at": p.created_at.isoformat()} for p in points],
        cursor=Cursor(events[-1].id if events else cursor.event_id, points[-1].id if points else cursor.point_id),
        full=len(events) == EVENT_BATCH or len(points) == POINT_BATCH)


def message(kind: str, data: Any, cursor: Cursor) -> str:
    """One SSE message of the feed, carrying the cursor as its id."""
    return sse_message(data, event=kind, id=str(cursor), separators=COMPACT)


def messages(poll: Poll, cursor: Cursor, last_state: dict[str, Any] | None) -> list[str]:
    """The messages one poll produces, each with the cursor just past what it carries."""
    out = []
    for event in poll.events:
        cursor = Cursor(event["id"], cursor.point_id)
        out.append(message("job_event", event, cursor))
    for start in range(0, len(poll.points), POINTS_PER_MESSAGE):
        chunk = poll.points[start:start + POINTS_PER_MESSAGE]
        cursor = Cursor(cursor.event_id, chunk[-1]["id"])
        out.append(message("metrics", {"points": chunk}, cursor))
    if poll.state != last_state:
        out.append(message("state", poll.state, poll.cursor))
    return out


async def job_feed(make_session: sessionmaker[Session], settings: Settings, slots: StreamSlots, *, tenant: str,
                   job_id: str, cursor: Cursor, since_step: int,
                   disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[str]:
    """The SSE body. It takes one of the tenant's slots when it starts and gives it back however it ends (a body
    the server never started, because the client left first, holds none)."""
    try:
        slots.acquire(tenant)
    except TooManyRequests as exc:  # another stream took the last slot since the route checked
        yield message("error", exc.envelope(), cursor)
        return
    try:
        last_state: dict[str, Any] | None = None
        yield sse_retry(2000)  # EventSource clients reconnect after 2 s, with Last-Event-ID
        last_sent = time.monotonic()
        while True:
            poll = await run_in_threadpool(read_once, make_session, job_id=job_id, cursor=cursor,
                                           since_step=since_step)
            for text in messages(poll, cursor, last_state):
                yield text
                last_sent = time.monotonic()
            cursor, last_state = poll.cursor, poll.state
            if poll.full:
                continue
            if JobStatus(poll.state["status"]) in TERMINAL:
                yield message("end", {"status": poll.state["status"]}, cursor)
                return
            await asyncio.sleep(settings.event_stream_poll_s)
            if await disconnected():
                return
            if time.monotonic() - last_sent >= settings.event_stream_heartbeat_s:
                yield sse_comment("ping")  # keeps proxies from closing an idle stream, and finds a gone client
                last_sent = time.monotonic()
    finally:
        slots.release(tenant)
