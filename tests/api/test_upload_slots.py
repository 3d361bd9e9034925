"""Concurrent uploads are bounded per tenant across API processes and per process, and a body must keep coming:
real uvicorn servers and clients that stall or trickle mid-upload."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from app.main import create_app
from tests.conftest import make_key
from tests.factories import sentiment_rows, tsv_bytes


@contextmanager
def running(settings, queue) -> Iterator[str]:
    """An API process (uvicorn in a thread) on a free port; its base URL."""
    config = uvicorn.Config(create_app(settings=settings, task_queue=queue), host="127.0.0.1", port=0,
                            log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture()
def server(settings, queue) -> Iterator[tuple[str, str]]:
    settings.max_concurrent_uploads = 1
    with running(settings, queue) as url:
        yield url, make_key(settings.resolved_database_url, tenant="tenant-a")


def _stalled_upload(url: str, key: str) -> socket.socket:
    """Send the headers and the start of a multipart body, then stall, holding the upload open."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (f"POST /datasets HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: multipart/form-data; boundary=BOUND\r\nContent-Length: 100000\r\n\r\n")
    part = '--BOUND\r\nContent-Disposition: form-data; name="file"; filename="t.tsv"\r\n\r\nsentence\tlabel\n'
    sock.sendall(head.encode() + part.encode())
    return sock


def test_uploads_beyond_the_bound_get_429_and_a_slot_comes_back(server):
    url, key = server
    headers = {"Authorization": f"Bearer {key}"}
    files = {"file": ("t.tsv", tsv_bytes(sentiment_rows()))}
    stalled = _stalled_upload(url, key)
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        deadline = time.monotonic() + 10
        while True:  # the stalled upload's slot is taken as soon as uvicorn hands its request to the app
            refused = client.post("/datasets", files=files)
            if refused.status_code == 429 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "too_many_uploads"
        assert int(refused.headers["Retry-After"]) >= 1
        assert client.get("/datasets").status_code == 200  # other routes are not held up
        stalled.close()  # the client goes away: its slot is given back
        deadline = time.monotonic() + 10
        while (accepted := client.post("/datasets", files=files)).status_code == 429:
            assert time.monotonic() < deadline, "the slot of a dropped upload was never released"
            time.sleep(0.1)
        assert accepted.status_code == 201, accepted.text
        assert client.post("/datasets", files=files).status_code == 201  # one at a time is fine


def _until(condition, what: str, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return result


def test_a_tenants_stalled_uploads_take_its_own_slots_in_every_process_not_the_others(settings, queue):
    """Slots were per API process: four trickling uploads of one tenant gave every other tenant 429."""
    settings.max_concurrent_uploads, settings.uploads_per_tenant = 8, 1
    key_a = make_key(settings.resolved_database_url, tenant="tenant-a")
    key_b = make_key(settings.resolved_database_url, tenant="tenant-b")
    files = {"file": ("t.tsv", tsv_bytes(sentiment_rows()))}
    with running(settings, queue) as first, running(settings, queue) as second:
        stalled = _stalled_upload(first, key_a)
        with httpx.Client(base_url=second, timeout=30) as client:
            refused = _until(lambda: (r := client.post("/datasets", files=files, headers={
                "Authorization": f"Bearer {key_a}"})).status_code == 429 and r, "tenant-a was never refused")
            assert refused.json()["error"]["code"] == "too_many_uploads" and "this tenant" in refused.text
            other = client.post("/datasets", files=files, headers={"Authorization": f"Bearer {key_b}"})
            assert other.status_code == 201, other.text
            nobody = client.post("/datasets", files=files, headers={"Authorization": "Bearer ts_wrong"})
            assert nobody.status_code == 401 and nobody.json()["error"]["field"] == "authorization"
            stalled.close()
            _until(lambda: client.post("/datasets", files=files, headers={
                "Authorization": f"Bearer {key_a}"}).status_code == 201, "tenant-a's slot never came back")


def _answer(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    return data


def test_a_stalled_body_is_answered_408_and_its_slot_comes_back(settings, queue):
    """A body that stopped coming (1 byte every 25 s in the audit) held its upload slot for ever."""
    settings.max_concurrent_uploads, settings.min_body_rate_bytes, settings.body_grace_s = 1, 1000, 1.0
    with running(settings, queue) as url:
        key = make_key(settings.resolved_database_url, tenant="tenant-a")
        started = time.monotonic()
        answer = _answer(_stalled_upload(url, key), timeout=10)
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer
        assert time.monotonic() - started < 8
        files = {"file": ("t.tsv", tsv_bytes(sentiment_rows()))}
        accepted = httpx.post(f"{url}/datasets", files=files, headers={"Authorization": f"Bearer {key}"})
        assert accepted.status_code == 201, accepted.text


def test_a_trickled_body_is_cut_at_the_body_deadline(settings, queue):
    settings.min_body_rate_bytes, settings.body_timeout_s = 0, 1.5
    with running(settings, queue) as url:
        key = make_key(settings.resolved_database_url, tenant="tenant-a")
        sock = _stalled_upload(url, key)
        started, answer = time.monotonic(), b""
        sock.settimeout(0.2)
        while time.monotonic() - started < 8 and not answer:
            try:
                sock.sendall(b"word\t1\n" * 20)
                answer = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert 1.0 < time.monotonic() - started < 6
