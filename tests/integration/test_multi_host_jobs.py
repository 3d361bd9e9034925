"""Jobs on several nodes: two worker "hosts" on one machine (own homes, one CPU device each) sharing PostgreSQL,
Redis and a store folder join one rendezvous per job; the head (node 0) reports, and a lost node costs the steps
since the last checkpoint only. (That two nodes train like one process: tests/unit/test_engine_nodes.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from core.capacity import live_workers
from tests.conftest import make_key
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload
from tests.integration.conftest import wait_for
from tests.tiny_models import build_tiny_bert

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

HYPER = {"batch_size": 8, "learning_rate": 5e-3, "warmup_ratio": 0.1, "max_length": 32, "eval_steps": None}


@pytest.fixture()
def store(tmp_path) -> Path:
    return tmp_path / "store"  # the folder every host mounts


@pytest.fixture()
def api(settings, redis_url, store, tmp_path):
    settings.redis_url = redis_url
    settings.storage_url = str(store)
    settings.home = tmp_path / "api-host"
    with TestClient(create_app(settings=settings)) as client:  # the real Celery task queue
        client.headers["Authorization"] = f"Bearer {make_key(settings.resolved_database_url)}"
        yield client


@pytest.fixture()
def start_host(start_worker, store, tmp_path, redis_url):
    """start_host(name): a training worker with one CPU device and its own home, as on a host of its own."""

    def start(name: str) -> subprocess.Popen[bytes]:
        return start_worker("training", TRAINSERVE_HOME=str(tmp_path / f"host-{name}"),
                            TRAINSERVE_STORAGE_URL=str(store), TRAINSERVE_WORKER_ADDRESS="127.0.0.1",
                            TRAINSERVE_GANG_TIMEOUT_S="60", TRAINSERVE_HEARTBEAT_TIMEOUT_S="10", OMP_NUM_THREADS="1")

    return start


@pytest.fixture()
def model_dir(tmp_path_factory) -> Path:
    # No dropout: one process and two then see the same function, so their losses can be compared step by step.
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-nodes") / "bert", seed=0, dropout=0.0)


def submit(api: TestClient, model: Path, dataset: str, **fields: object) -> str:
    hyper = {**HYPER, **fields.pop("hyperparameters", {})}  # type: ignore[dict-item]
    body = job_body(dataset, dataset, base_model=str(model), hyperparameters=hyper, **fields)
    response = api.post("/jobs", json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def finished(api: TestClient, job_id: str, timeout: float = 180) -> dict:
    done = wait_for(lambda: (j := api.get(f"/jobs/{job_id}").json())["status"] in ("succeeded", "failed") and j,
                    timeout, f"job {job_id} to finish")
    assert done["status"] == "succeeded", done["error"]
    return done


def losses(api: TestClient, job_id: str) -> list[tuple[int, float]]:
    points = api.get(f"/jobs/{job_id}/metrics", params={"name": "train_loss"}).json()["data"]
    return [(p["step"], p["value"]) for p in points]


def joined(log: Path) -> bool:
    return "joining as node 1 of 2" in log.read_text(errors="replace")


def both_reported(redis_url: str) -> bool:
    return len(live_workers(redis_url) or []) == 2


def test_a_lost_node_costs_the_steps_since_the_last_checkpoint(api, start_host, model_dir, redis_url, tmp_path):
    workers = {"a": start_host("a"), "b": start_host("b")}
    wait_for(lambda: both_reported(redis_url), 60, "both workers to report their device")
    dataset = upload(api, tsv_bytes(sentiment_rows(4))).json()["id"]
    job_id = submit(api, model_dir, dataset, nodes=2, hyperparameters={"max_steps": 40})

    def checkpointed() -> bool:
        job = api.get(f"/jobs/{job_id}").json()
        assert job["status"] in ("queued", "running"), job
        return any(a["kind"] == "checkpoint" for a in job["artifacts"])  # rows are written after the upload

    wait_for(checkpointed, 180, "a checkpoint in the store")
    logs = {name: tmp_path / f"worker-training-{i}.log" for i, name in enumerate(workers)}
    lost = next(name for name, log in logs.items() if joined(log))
    os.kill(workers[lost].pid, signal.SIGKILL)  # the whole host: its torchrun and ranks die with the worker
    workers[lost].wait()
    start_host("c")  # a host to form the gang anew with

    done = finished(api, job_id, 240)
    assert done["attempts"] == 2 and done["progress"]["step"] == 40
    events = api.get(f"/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    assert any(e["kind"] == "requeued" and "a node was lost" in e["message"] for e in events), events
    started = [e["message"] for e in events if e["kind"] == "started"]
    assert len(started) == 2 and "resumed from checkpoint at step" in started[1], started
    assert all("training on cpu x2" in message for message in started)  # one rank 0 per gang, for both nodes
    resumed_at = int(started[1].rsplit(" ", 1)[1])
    assert 5 <= resumed_at < 40  # not redone from zero
    steps = Counter(s for s, _ in losses(api, job_id))
    assert sorted(steps) == list(range(1, 41)) and max(steps.values()) == 1  # one history across both gangs
