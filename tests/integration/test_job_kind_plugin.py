"""A job kind from outside the package, end to end on real processes: tests.toy_kind (spec) and tests.toy_engine
(engine) are named by TRAINSERVE_JOB_KIND_MODULES only; the API registers the kind when it builds its app, a
real Celery worker process when it starts, and no other file knows the kind."""

from __future__ import annotations

import io
import json
import sys
import tarfile

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from core.jobspec import KINDS, unregister
from tests.conftest import make_key
from tests.factories import sentiment_rows, tsv_bytes, upload
from tests.integration.conftest import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOY = "text-length"  # the kind tests.toy_kind adds; this module does not import it
MODULES = "tests.toy_kind"


@pytest.fixture()
def plugin_client(settings, redis_url):
    """An API on the real task queue built with TRAINSERVE_JOB_KIND_MODULES, as a fresh API process would be."""
    unregister(TOY)
    sys.modules.pop(MODULES, None)  # a test before this one may have imported it: import it afresh, as a new process
    assert TOY not in KINDS
    settings.redis_url = redis_url
    settings.job_kind_modules = MODULES
    try:
        with TestClient(create_app(settings=settings)) as client:
            client.headers["Authorization"] = f"Bearer {make_key(settings.resolved_database_url)}"
            yield client
    finally:
        unregister(TOY)
        sys.modules.pop(MODULES, None)


def test_a_kind_from_a_plugin_module_runs_on_a_worker_process(plugin_client, start_worker):
    client = plugin_client
    document = client.get("/openapi.json").json()
    assert "ToyJob" in document["components"]["schemas"]  # the body schema lists the kind the setting added
    assert document["components"]["schemas"]["ToyHyperparameters"]["properties"]["learning_rate"]["default"] == 0.05
    start_worker("training", TRAINSERVE_JOB_KIND_MODULES=MODULES)
    dataset = upload(client, tsv_bytes(sentiment_rows(2))).json()["id"]
    refused = client.post("/jobs", json={"task": TOY, "train_dataset": dataset, "text_column": "sentence",
                                         "hyperparameters": {"learning_rate": 2}})
    assert refused.status_code == 422, refused.text  # validated by the kind's own hyperparameters model
    assert refused.json()["error"]["field"] == "hyperparameters.learning_rate"
    response = client.post("/jobs", json={"task": TOY, "train_dataset": dataset, "text_column": "sentence",
                                          "hyperparameters": {"max_steps": 30, "eval_steps": 10}})
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]

    def finished():
        job = client.get(f"/jobs/{job_id}").json()
        return job if job["status"] in ("succeeded", "failed", "cancelled") else None

    job = wait_for(finished, 180, "the toy job to finish")
    assert job["status"] == "succeeded" and job["task"] == TOY, job["error"]
    assert job["hyperparameters"]["learning_rate"] == 0.05  # the kind's default, from its model
    assert job["progress"]["step"] == 30 and job["best"]["metric"] == "eval_mae"
    maes = [p["value"] for p in client.get(f"/jobs/{job_id}/metrics").json()["data"] if p["name"] == "eval_mae"]
    assert len(maes) == 3 and maes[-1] < maes[0]  # evaluated at steps 10, 20, 30 on the worker, and it learned
    model = next(a for a in job["artifacts"] if a["kind"] == "model")
    assert {"manifest.json", "model.safetensors"} <= set(model["files"])
    download = client.get(f"/jobs/{job_id}/artifacts/{model['id']}/download")
    assert download.status_code == 200, download.text
    with tarfile.open(fileobj=io.BytesIO(download.content)) as archive:
        manifest = next(m for m in archive.getmembers() if m.name.endswith("manifest.json"))
        assert json.load(archive.extractfile(manifest))["task"] == TOY  # type: ignore[arg-type]
