"""Slow clients, slow resolvers and concurrent bursts against a real server (uvicorn in a thread, PostgreSQL).

No request holds a database connection while it waits on a client or the network: with a pool of 2, slow
downloads, slow uploads and slow webhook registrations leave /health and another tenant fast. Admission
is atomic: concurrent bursts stop exactly at the job limit and the webhook endpoint cap.
"""

from __future__ import annotations

import io
import os
import socket
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from app.main import create_app
from core import netguard
from tests.conftest import make_key
from tests.factories import job_body, sentiment_rows, tsv_bytes
from tests.hostile_clients import download_request, job_with_artifact, stalled

pytestmark = pytest.mark.timeout(240)


@contextmanager
def serve(settings, queue) -> Iterator[str]:
    """The app on a real HTTP server (uvicorn, this process) on a free port; yields its base URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(settings=settings, task_queue=queue), host="127.0.0.1",
                                           port=port, log_level="warning", timeout_keep_alive=30))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def _slow_upload_request(key: str) -> bytes:
    """A multipart upload announcing 1 MB and sending its first few hundred bytes."""
    head = b'--b\r\nContent-Disposition: form-data; name="file"; filename="t.tsv"\r\n\r\nsentence\tlabel\n'
    return (f"POST /datasets HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 1000000\r\n\r\n").encode() + head


def _timed(method: str, url: str, **kwargs) -> tuple[float, httpx.Response]:
    started = time.monotonic()
    response = httpx.request(method, url, timeout=30, **kwargs)
    return time.monotonic() - started, response


@pytest.fixture()
def slow_dns(monkeypatch):
    """A resolver that takes 8 s for names under .slow.test (then answers a public address), as a slow or
    attacker-run DNS server would; every other name resolves as usual."""
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if isinstance(host, str) and host.endswith(".slow.test"):
            time.sleep(8)
            return real("93.184.216.34", port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(netguard.socket, "getaddrinfo", getaddrinfo)


def test_with_a_pool_of_two_slow_clients_leave_health_and_other_tenants_fast(settings, queue, factory, slow_dns):
    settings.db_pool_size, settings.db_max_overflow, settings.db_pool_timeout_s = 2, 0, 10.0
    settings.max_downloads_per_tenant, settings.webhook_dns_timeout_s = 8, 20.0
    hostile, calm = make_key(settings.resolved_database_url, tenant="hostile"), \
        make_key(settings.resolved_database_url, tenant="calm")
    with serve(settings, queue) as base:
        job_id, artifact_id, _ = job_with_artifact(base, hostile, settings.home, factory)
        held = [stalled(base, download_request(job_id, artifact_id, hostile), read=1024) for _ in range(6)]
        held += [stalled(base, _slow_upload_request(hostile)) for _ in range(3)]
        registrations = ThreadPoolExecutor(4)
        slow_hooks = [registrations.submit(httpx.post, f"{base}/webhooks", timeout=30,
                                           json={"url": f"https://hook{i}.slow.test/x", "event_types": ["job.queued"]},
                                           headers={"Authorization": f"Bearer {hostile}"}) for i in range(4)]
        time.sleep(1.0)  # every slow request is in the server now
        try:
            # Fast means far below the pool timeout (10 s) a held pool would make them wait; the bound leaves
            # room for a shared, loaded test machine.
            for _ in range(5):
                took, health = _timed("GET", f"{base}/health")
                assert health.status_code == 200 and took < 2.0, (took, health.text)
                took, jobs = _timed("GET", f"{base}/jobs", headers={"Authorization": f"Bearer {calm}"})
                assert jobs.status_code == 200 and took < 2.0, (took, jobs.text)
            assert not any(f.done() for f in slow_hooks)  # the resolver is still answering them
            assert [f.result().status_code for f in slow_hooks] == [201] * 4
        finally:
            for sock in held:
                sock.close()
            registrations.shutdown()


def test_downloads_stream_from_the_store_without_temporary_copies_and_are_bounded_per_tenant(settings, queue,
                                                                                               factory):
    settings.max_downloads_per_tenant = 2
    key, other = make_key(settings.resolved_database_url, tenant="a"), make_key(settings.resolved_database_url)
    temporary = set(os.listdir(tempfile.gettempdir()))
    with serve(settings, queue) as base:
        job_id, artifact_id, data = job_with_artifact(base, key, settings.home, factory)
        url = f"{base}/jobs/{job_id}/artifacts/{artifact_id}/download"
        whole = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert whole.status_code == 200 and int(whole.headers["content-length"]) == len(whole.content)
        assert whole.headers["content-disposition"] == f'attachment; filename="{job_id}-model.tar"'
        with tarfile.open(fileobj=io.BytesIO(whole.content)) as tar:
            assert tar.getnames() == ["model/config.json", "model/model.safetensors"]
            assert tar.extractfile("model/model.safetensors").read() == data  # type: ignore[union-attr]
        held = [stalled(base, download_request(job_id, artifact_id, key), read=1024) for _ in range(2)]
        time.sleep(0.5)
        refused = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_downloads"
        assert int(refused.headers["retry-after"]) >= 1
        assert not set(os.listdir(tempfile.gettempdir())) - temporary  # nothing spooled, however slow the reader
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 10  # the slots come back once the server sees the clients gone
        while time.monotonic() < deadline:
            again = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
            if again.status_code == 200:
                break
            time.sleep(0.3)
        assert again.status_code == 200 and again.content == whole.content
        assert httpx.get(url, headers={"Authorization": f"Bearer {other}"}).status_code == 404


def test_concurrent_bursts_stop_exactly_at_the_job_limit_and_the_endpoint_cap(settings, queue):
    settings.max_active_jobs_per_tenant = 5
    key = make_key(settings.resolved_database_url, tenant="burst")
    auth = {"Authorization": f"Bearer {key}"}
    with serve(settings, queue) as base:
        dataset = httpx.post(f"{base}/datasets", files={"file": ("t.tsv", tsv_bytes(sentiment_rows()))},
                             headers=auth).json()["id"]
        with ThreadPoolExecutor(30) as pool:
            jobs = list(pool.map(lambda _: httpx.post(f"{base}/jobs", json=job_body(dataset), headers=auth,
                                                      timeout=60).status_code, range(30)))
            hooks = list(pool.map(lambda i: httpx.post(
                f"{base}/webhooks", headers=auth, timeout=60,
                json={"url": f"https://93.184.216.{i % 250}/hook", "event_types": ["job.queued"]}).status_code,
                range(60)))
        assert sorted(set(jobs)) == [201, 429] and jobs.count(201) == 5, jobs
        assert hooks.count(201) == settings.max_webhook_endpoints and set(hooks) == {201, 429}, hooks
        assert len(httpx.get(f"{base}/webhooks", headers=auth).json()) == settings.max_webhook_endpoints
        assert len(httpx.get(f"{base}/jobs", headers=auth).json()["data"]) == 5


def test_a_pool_timeout_is_503_database_unavailable_with_retry_after(client, settings):
    engine = client.app.state.engine
    engine.pool._timeout = 1.0  # the pool the app built (5 + 10); every connection taken below
    held = [engine.connect() for _ in range(engine.pool.size() + engine.pool._max_overflow)]
    try:
        response = client.get("/jobs")
        assert response.status_code == 503 and response.json()["error"]["code"] == "database_unavailable"
        assert int(response.headers["retry-after"]) >= 1
    finally:
        for conn in held:
            conn.close()
    assert client.get("/jobs").status_code == 200
