"""Concurrent uploads are bounded per API process: a real uvicorn server and a client that stalls mid-upload."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from app.main import create_app
from tests.conftest import make_key
from tests.factories import sentiment_rows, tsv_bytes


@pytest.fixture()
def server(settings, queue) -> Iterator[tuple[str, str]]:
    settings.max_concurrent_uploads = 1
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
    yield f"http://127.0.0.1:{port}", make_key(settings.resolved_database_url, tenant="tenant-a")
    server.should_exit = True
    thread.join(15)


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
