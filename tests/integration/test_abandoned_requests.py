"""Clients that give up, against a real uvicorn API process, real Redis and real Celery worker processes.

A dropped stream or a dropped non-streaming request frees its slot, sets the cancel flag and stops the
worker early; /classify waits without holding threads, times out with 504 and leaves tasks a worker skips.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis as redis_lib

from core.db import make_engine, make_sessionmaker, session_scope
from core.protocol import DoneEvent, parse_event
from core.redis_keys import cancel_key, stream_key
from core.rows import Job, JobStatus, TaskKind, new_id
from core.tasks import QUEUE_INFERENCE
from tests.conftest import make_key
from tests.integration.conftest import wait_for
from tests.tiny_lm import build_tiny_gpt2

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ASKED = 4000  # far more tokens than a fast engine generates before it sees the cancel flag, even on a busy CPU
SLOTS = "trainserve:slots:tiny"
TENANT = "tenant-abandon"
CLASSIFY_TIMEOUT_S = 6
ABANDONED = "trainserve:classify:*:abandoned"


@dataclass
class Api:
    url: str
    port: int
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture()
def api(start_api, settings) -> Api:
    """`trainserve api` (uvicorn) in its own process, with a short /classify timeout."""
    build_tiny_gpt2(settings.home / "models" / "tiny", n_positions=ASKED + 64)
    # 41 calls of one tenant wait at once below: more than its share of the inference queue by default.
    url = start_api(TRAINSERVE_CLASSIFY_TIMEOUT_S=str(CLASSIFY_TIMEOUT_S), TRAINSERVE_MAX_NEW_TOKENS=str(ASKED),
                    TRAINSERVE_INFERENCE_PER_TENANT="64")
    return Api(url, int(url.rsplit(":", 1)[1]), make_key(settings.resolved_database_url, tenant=TENANT))


@pytest.fixture()
def store(redis_url: str) -> Iterator[redis_lib.Redis]:
    client = redis_lib.Redis.from_url(redis_url)
    yield client
    client.close()


def _done(store: redis_lib.Redis, request_id: str) -> DoneEvent | None:
    events = [parse_event(fields[b"data"]) for _, fields in store.xrange(stream_key(request_id))]
    return events[-1] if events and isinstance(events[-1], DoneEvent) else None


def _assert_abandoned(store: redis_lib.Redis, request_id: str) -> None:
    wait_for(lambda: store.zcard(SLOTS) == 0, 30, "the in-flight slot to be released")
    assert store.exists(cancel_key(request_id))
    done = wait_for(lambda: _done(store, request_id), 60, "the worker to drop the request")
    assert done.choices[0].finish_reason == "cancelled"
    assert 0 < done.usage.completion_tokens < ASKED


def test_a_stream_dropped_after_the_first_token_frees_its_slot_and_stops_the_worker(api, start_worker, store):
    start_worker("generation")
    body = {"model": "tiny", "prompt": "Hello", "max_new_tokens": ASKED, "seed": 1, "stream": True}
    with httpx.Client(base_url=api.url, headers=api.headers, timeout=120) as client, \
            client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        request_id = json.loads(first.removeprefix("data: "))["id"]
        assert store.zcard(SLOTS) == 1, first
    _assert_abandoned(store, request_id)  # the connection is closed here, mid-stream


def _send(api: Api, path: str, body: dict) -> socket.socket:
    """A raw HTTP/1.1 POST whose connection the test can drop at will."""
    raw = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", api.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n".encode()
                 + f"Authorization: Bearer {api.key}\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
    return sock


def test_a_dropped_non_streaming_request_frees_its_slot_and_stops_the_worker(api, start_worker, store):
    start_worker("generation")
    sock = _send(api, "/generate", {"model": "tiny", "prompt": "Hello", "max_new_tokens": ASKED, "seed": 2})
    # Its rows' members are "<request id>#<row>" (a request of n choices holds n rows).
    member = wait_for(lambda: store.zrange(SLOTS, 0, -1), 60, "the request to take a slot")[0].decode()
    request_id = member.rsplit("#", 1)[0]
    wait_for(lambda: store.xlen(stream_key(request_id)) >= 3, 60, "the first tokens")  # accepted + tokens
    sock.close()
    _assert_abandoned(store, request_id)


def _succeeded_classifier(database_url: str) -> str:
    engine = make_engine(database_url)
    job_id = new_id("job")
    with session_scope(make_sessionmaker(engine)) as session:
        session.add(Job(id=job_id, tenant_id=TENANT, status=JobStatus.SUCCEEDED, task=TaskKind.TEXT_CLASSIFICATION,
                        text_column="sentence", label_column="label", hyperparameters={}))
    engine.dispose()
    return job_id


def test_classify_waits_without_threads_times_out_504_and_a_later_worker_skips(api, settings, start_worker, store,
                                                                                tmp_path):
    job_id = _succeeded_classifier(settings.resolved_database_url)

    # A caller that hangs up is noticed while waiting: its task is marked well before the timeout.
    sock = _send(api, "/classify", {"model": job_id, "texts": ["hi"]})
    wait_for(lambda: store.llen(QUEUE_INFERENCE) == 1, 30, "the task to be queued")
    sock.close()
    dropped = time.monotonic()
    wait_for(lambda: store.keys(ABANDONED), 30, "the dropped call's task to be marked abandoned")
    assert time.monotonic() - dropped < CLASSIFY_TIMEOUT_S - 2

    async def calls() -> tuple[list[httpx.Response], list[float]]:
        async with httpx.AsyncClient(base_url=api.url, headers=api.headers, timeout=60) as client:
            pending = [asyncio.ensure_future(client.post("/classify", json={"model": job_id, "texts": ["hi"]}))
                       for _ in range(40)]
            await asyncio.sleep(0.5)
            health = []
            while not all(p.done() for p in pending):
                started = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                health.append(time.monotonic() - started)
                await asyncio.sleep(0.2)
            return [p.result() for p in pending], health

    responses, health = asyncio.run(calls())
    # /health stays answered while the calls wait (no thread is held): well under the 60 s the calls wait, with
    # room for a 2-core machine's scheduling noise (one sample at 1.0 s seen in a fresh-clone run).
    assert len(health) >= 3 and max(health) < 2.0, health
    for response in responses:
        assert response.status_code == 504 and response.json()["error"]["code"] == "worker_timeout", response.text
    assert len(store.keys(ABANDONED)) == 41
    assert store.llen(QUEUE_INFERENCE) == 41  # nobody consumed them

    start_worker("inference")
    log = tmp_path / "worker-inference-0.log"
    wait_for(lambda: log.read_text().count("its caller has given up") == 41, 120, "the worker to skip all 41 tasks")
    assert store.llen(QUEUE_INFERENCE) == 0 and not store.keys("trainserve:classify:*:reply")
