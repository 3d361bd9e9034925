"""Two worker hosts on one machine: own home folders and no shared disk, one PostgreSQL, Redis and S3 store.

A job is SIGKILLed on the host that trains it once a checkpoint is in the store; the other host's reaper
requeues it, that host resumes from the stored checkpoint, finishes, and serves the model from the store.
"""

from __future__ import annotations

import io
import os
import signal
import tarfile

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from core.storage import open_storage
from tests.conftest import make_key
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload
from tests.integration.conftest import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_STEPS = 80  # a quiet CPU runs this in seconds: the kill after the first checkpoint (step 5) comes well before


@pytest.fixture()
def api(settings, redis_url, s3_url, tmp_path):
    settings.redis_url = redis_url
    settings.storage_url = s3_url
    settings.home = tmp_path / "api-host"
    with TestClient(create_app(settings=settings)) as client:  # the real Celery task queue
        client.headers["Authorization"] = f"Bearer {make_key(settings.resolved_database_url)}"
        yield client


def test_a_job_killed_on_one_host_resumes_and_is_served_on_the_other(api, settings, s3_server, s3_url,
                                                                      start_worker, tiny_bert_dir, tmp_path):
    homes = {"a": tmp_path / "host-a", "b": tmp_path / "host-b"}

    def host(name: str) -> dict[str, str]:
        return {"TRAINSERVE_HOME": str(homes[name]), "TRAINSERVE_STORAGE_URL": s3_url,
                "TRAINSERVE_HEARTBEAT_TIMEOUT_S": "4", "TRAINSERVE_CHECKPOINT_STEPS": "5", **s3_server.env}

    trainers = {name: start_worker("training", **host(name)) for name in homes}
    dataset = upload(api, tsv_bytes(sentiment_rows(4))).json()["id"]
    store = open_storage(settings)
    assert store.children("datasets") == [f"{dataset}.tsv"]  # uploaded to the store, not kept by the API host
    assert not (settings.home / "datasets" / f"{dataset}.tsv").exists()
    hyper = {"max_steps": MAX_STEPS, "batch_size": 8, "learning_rate": 1e-2, "max_length": 32, "eval_steps": None}
    response = api.post("/jobs", json=job_body(dataset, dataset, base_model=str(tiny_bert_dir), hyperparameters=hyper))
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]

    def trainer_with_a_stored_checkpoint() -> str | None:
        job = api.get(f"/jobs/{job_id}").json()
        assert job["status"] in ("queued", "running"), job
        if not any(a["kind"] == "checkpoint" for a in job["artifacts"]):  # rows are written after the upload
            return None
        return next(name for name, home in homes.items() if (home / "jobs" / job_id).exists())

    first = wait_for(trainer_with_a_stored_checkpoint, 300, "a checkpoint uploaded by the training host")
    second = "b" if first == "a" else "a"
    os.kill(trainers[first].pid, signal.SIGKILL)
    trainers[first].wait()
    killed = api.get(f"/jobs/{job_id}").json()
    assert killed["status"] == "running" and killed["attempts"] == 1, "the job ended before it could be killed"
    start_worker("inference", **host(second))

    done = wait_for(lambda: (j := api.get(f"/jobs/{job_id}").json())["status"] in ("succeeded", "failed") and j,
                    300, "the job to finish on the other host")
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 2 and done["progress"]["step"] == MAX_STEPS
    events = api.get(f"/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    started = [e["message"] for e in events if e["kind"] == "started"]
    assert len(started) == 2 and "resumed from checkpoint at step" in started[1], started
    steps = [p["step"] for p in api.get(f"/jobs/{job_id}/metrics", params={"name": "train_loss"}).json()["data"]]
    assert steps == list(range(1, MAX_STEPS + 1))  # one history across both hosts, no gap, no repeat

    response = api.post("/classify", json={"model": job_id, "texts": ["i loved every minute",
                                                                      "boring and far too long"]})
    assert response.status_code == 200, response.text
    assert [p["label"] for p in response.json()["predictions"]] == [1, 0]
    model_key = f"jobs/{job_id}/model"
    assert (homes[second] / "cache" / model_key / "manifest.json").is_file()  # served from its copy of the store's
    assert not (homes[second] / "jobs" / job_id).exists()  # its work folder went once the model was stored
    assert not (homes[first] / model_key).exists() and not (homes[first] / "cache" / model_key).exists()
    assert not (settings.home / "jobs").exists()

    model = next(a for a in done["artifacts"] if a["kind"] == "model")
    download = api.get(model["download_url"])  # streamed from the store into the archive
    assert download.status_code == 200, download.text
    with tarfile.open(fileobj=io.BytesIO(download.content)) as tar:
        names = tar.getnames()
    assert "model/manifest.json" in names and "model/model.safetensors" in names
