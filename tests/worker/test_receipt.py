"""Reproducibility receipts, reruns and comparisons: the runner in-process on real PostgreSQL and a tiny BERT."""

from __future__ import annotations

import pytest

from tests.conftest import make_key
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload
from tests.tiny_models import build_tiny_bert


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-receipt") / "bert")


@pytest.fixture()
def run(settings, queue):
    from worker.context import WorkerContext
    from worker.training.lifecycle import run_training_job

    ctx = WorkerContext(settings, queue)
    yield lambda job_id: run_training_job(ctx, job_id)
    ctx.close()


def test_receipt_rerun_and_compare(client, run, tiny_bert, settings):
    dataset = upload(client, tsv_bytes(sentiment_rows(2))).json()
    body = job_body(dataset["id"], base_model=str(tiny_bert),
                    hyperparameters={"max_steps": 3, "batch_size": 8, "max_length": 16, "seed": 7})
    original = client.post("/jobs", json=body).json()
    assert original["receipt"] is None and original["queue_position"] == 1
    assert run(original["id"]) == "succeeded"
    job = client.get(f"/jobs/{original['id']}").json()
    receipt = job["receipt"]
    assert receipt["seed"] == 7 and receipt["datasets"] == {"train": dataset["sha256"]}
    assert receipt["device"] == job["device"] == "cpu" and receipt["precision"] in ("fp32", "bf16")
    assert {"torch", "transformers", "python"} <= set(receipt["libraries"])
    assert set(receipt["code"]) == {"version", "git_commit"}
    assert receipt["config"]["hyperparameters"] == job["hyperparameters"]
    assert job["queue_position"] is None and job["waiting_reason"] is None

    key = {"Idempotency-Key": "rerun-1"}
    rerun = client.post(f"/jobs/{job['id']}/rerun", headers=key)
    assert rerun.status_code == 201, rerun.text
    again = client.post(f"/jobs/{job['id']}/rerun", headers=key).json()
    assert again["id"] == rerun.json()["id"] and again["rerun_of"] == job["id"]
    assert again["hyperparameters"] == job["hyperparameters"] and again["train_dataset"] == job["train_dataset"]
    assert run(again["id"]) == "succeeded"
    same = client.get("/jobs/compare", params={"ids": f"{job['id']},{again['id']}"}).json()
    assert same["differences"] == [] and same["identical"] > 10  # the same run, field by field

    changed = client.post("/jobs", json={**body, "hyperparameters": {**body["hyperparameters"],
                                                                     "learning_rate": 1e-3}}).json()
    diff = client.get("/jobs/compare", params={"ids": f"{job['id']},{changed['id']}"}).json()
    fields = {d["field"]: d["values"] for d in diff["differences"]}
    assert fields["hyperparameters.learning_rate"] == [job["hyperparameters"]["learning_rate"], 1e-3]
    assert fields["receipt.seed"] == [7, None]  # the new job has not run: no receipt yet

    assert client.get("/jobs/compare", params={"ids": job["id"]}).json()["error"]["field"] == "ids"
    other = {"Authorization": f"Bearer {make_key(settings.resolved_database_url, tenant='tenant-b')}"}
    assert client.get("/jobs/compare", params={"ids": f"{job['id']},{again['id']}"}, headers=other).status_code == 404
    assert client.post(f"/jobs/{job['id']}/rerun", headers=other).status_code == 404
