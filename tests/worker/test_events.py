"""The event pump against a real Redis: order kept across requests, the last event waits for the tokens."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis

from core.protocol import DoneEvent, TokenEvent, Usage
from tests.conftest import REDIS_URL
from worker.servers.events import EventPump, EventWriter


@pytest.fixture()
def client() -> redis.Redis:
    connection = redis.Redis.from_url(REDIS_URL)
    yield connection
    connection.close()


def _events(client: redis.Redis, key: str) -> list[str]:
    return [fields[b"data"].decode() for _, fields in client.xrange(key)]


def test_tokens_from_many_threads_arrive_in_order_and_done_comes_last(client) -> None:
    pump = EventPump(client)
    writers = [EventWriter(pump, uuid.uuid4().hex, ttl_s=60) for _ in range(4)]

    def stream(writer: EventWriter) -> None:
        for i in range(50):
            writer.token(TokenEvent(index=0, text=str(i)))
        writer.emit(DoneEvent(choices=[], usage=Usage(prompt_tokens=1, completion_tokens=50)))

    threads = [threading.Thread(target=stream, args=(w,)) for w in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    try:
        for writer in writers:
            events = _events(client, writer.key)
            assert [TokenEvent.model_validate_json(e).text for e in events[:-1]] == [str(i) for i in range(50)]
            assert DoneEvent.model_validate_json(events[-1]).usage.completion_tokens == 50
            assert 0 < client.ttl(writer.key) <= 60  # the last event set the expiry
    finally:
        client.delete(*(w.key for w in writers))


def test_a_failed_write_is_raised_to_the_request_that_waits(client) -> None:
    broken = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)  # nothing listens on port 1
    pump = EventPump(broken)
    writer = EventWriter(pump, uuid.uuid4().hex, ttl_s=60)
    writer.token(TokenEvent(index=0, text="lost"))  # queued: never raises on the decode thread
    with pytest.raises(redis.ConnectionError):
        writer.emit(DoneEvent(choices=[], usage=Usage(prompt_tokens=1, completion_tokens=1)))
    assert not client.exists(writer.key)  # nothing half-written
