"""Real processes: Celery workers started with the `trainserve` CLI against real Redis and PostgreSQL."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient

from app.main import create_app
from tests.conftest import INTEGRATION_REDIS, make_key
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload


@pytest.fixture()
def redis_url() -> str:
    client = redis_lib.Redis.from_url(INTEGRATION_REDIS)
    client.flushdb()  # an unreachable Redis fails the test: never a silent skip
    client.close()
    return INTEGRATION_REDIS


@pytest.fixture()
def worker_env(settings, redis_url) -> dict[str, str]:
    settings.redis_url = redis_url
    # Generation in fp32: "auto" decides by timing a calibration at load, so on a bf16-capable CPU the same test
    # could get bf16 weights in one run and fp32 in the next (and different seeded samples); tests of auto ask for it.
    return dict(os.environ, TRAINSERVE_HOME=str(settings.home), TRAINSERVE_DATABASE_URL=settings.resolved_database_url,
                TRAINSERVE_REDIS_URL=redis_url, TRAINSERVE_CHECKPOINT_STEPS="5", HF_HUB_OFFLINE="1",
                PYTHONUNBUFFERED="1", TRAINSERVE_GENERATION_PRECISION="fp32")


@pytest.fixture()
def start_worker(worker_env, tmp_path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(queues: str = "training", device: str = "cpu", devices: int = 1, env: dict[str, str] | None = None,
              **more_env: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"worker-{queues}-{len(started)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen([sys.executable, "-m", "trainserve.cli", "worker", "--device", device,
                                 "--devices", str(devices), "--queues", queues],
                                env={**worker_env, **(env or {}), **more_env}, stdout=log, stderr=subprocess.STDOUT)
        started.append(proc)
        return proc

    yield start
    stop_all(started)


def stop_all(procs: list[subprocess.Popen[bytes]], sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    """Signal every process first, then wait for each (their shutdowns overlap), killing what outlives `timeout`."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.send_signal(sig)
    deadline = time.monotonic() + timeout
    for proc in running:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture()
def live_client(settings, redis_url):
    """An API client on the real Celery task queue (workers started by start_worker consume it)."""
    settings.redis_url = redis_url
    with TestClient(create_app(settings=settings)) as client:
        client.headers["Authorization"] = f"Bearer {make_key(settings.resolved_database_url)}"
        yield client


def submit_job(client, tiny_bert_dir, devices: int = 1, **hp) -> str:
    """POST a small sentiment job on the tiny BERT; returns its id."""
    train = upload(client, tsv_bytes(sentiment_rows(4))).json()["id"]
    # lr 5e-3 with 10% warmup: the tiny BERT reaches accuracy 1.0 on every seed tried (1-10, 42), fp32 and bf16
    hyper = {"epochs": 6, "batch_size": 8, "learning_rate": 5e-3, "warmup_ratio": 0.1, "max_length": 32, **hp}
    response = client.post("/jobs", json=job_body(train, train, base_model=str(tiny_bert_dir), hyperparameters=hyper,
                                                  devices=devices))
    assert response.status_code == 201, response.text
    return response.json()["id"]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll until predicate() is truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture()
def start_api(worker_env, tmp_path) -> Iterator[Callable[..., str]]:
    """`trainserve api` (uvicorn) in its own process on a free port; start(**env) returns its base URL."""
    import httpx

    started: list[subprocess.Popen[bytes]] = []

    def start(**env: str) -> str:
        port = _free_port()
        log = open(tmp_path / "api.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen([sys.executable, "-m", "trainserve.cli", "api", "--port", str(port)],
                                env=dict(worker_env, **env), stdout=log, stderr=subprocess.STDOUT)
        started.append(proc)
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 60, "the API to answer /health")
        return url

    yield start
    stop_all(started, timeout=20)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A private redis-server without persistence, so a restart loses everything, as in production."""

    def __init__(self, tmp_path) -> None:
        self.port = _free_port()
        self.dir = tmp_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(self.port),
                                      "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                      "--dir", str(self.dir)], stdout=subprocess.DEVNULL)
        wait_for(lambda: subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True,
                                        text=True).stdout.strip() == "PONG", 10, "redis to start")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture()
def private_redis(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()
