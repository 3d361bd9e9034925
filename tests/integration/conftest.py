"""Real processes: Celery workers started with the `trainserve` CLI against real Redis and PostgreSQL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from tests.conftest import REDIS_URL

INTEGRATION_REDIS = os.environ.get("TRAINSERVE_TEST_INTEGRATION_REDIS_URL", REDIS_URL.rsplit("/", 1)[0] + "/7")


@pytest.fixture()
def redis_url() -> str:
    client = redis_lib.Redis.from_url(INTEGRATION_REDIS)
    client.flushdb()  # an unreachable Redis fails the test: never a silent skip
    client.close()
    return INTEGRATION_REDIS


@pytest.fixture()
def worker_env(settings, redis_url) -> dict[str, str]:
    settings.redis_url = redis_url
    return dict(os.environ, TRAINSERVE_HOME=str(settings.home), TRAINSERVE_DATABASE_URL=settings.resolved_database_url,
                TRAINSERVE_REDIS_URL=redis_url, TRAINSERVE_CHECKPOINT_STEPS="5", HF_HUB_OFFLINE="1",
                PYTHONUNBUFFERED="1")


@pytest.fixture()
def start_worker(worker_env, tmp_path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(queues: str = "training", device: str = "cpu") -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"worker-{queues}-{len(started)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen([sys.executable, "-m", "trainserve.cli", "worker", "--device", device,
                                 "--queues", queues], env=worker_env, stdout=log, stderr=subprocess.STDOUT)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll until predicate() is truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    from tests.tiny_models import build_tiny_bert

    return build_tiny_bert(tmp_path_factory.mktemp("tiny-int") / "bert")
