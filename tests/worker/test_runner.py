"""The worker's job runner in-process: real PostgreSQL rows, a tiny real BERT, no Celery."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from core.tasks import TASK_CLASSIFY
from tests.conftest import make_key
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload
from tests.tiny_models import build_tiny_bert


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return build_tiny_bert(tmp_path_factory.mktemp("tiny") / "bert")


@pytest.fixture()
def ctx(settings, queue):
    from worker.context import WorkerContext

    context = WorkerContext(settings, queue)
    yield context
    context.close()


@pytest.fixture()
def runner(ctx):
    """The runner's entry points bound to a test context (its own sessions, the recording queue)."""
    from worker.jobs.lifecycle import run_training_job

    return SimpleNamespace(run_training_job=lambda job_id: run_training_job(ctx, job_id))


def _submit(client, tiny_bert, **hp):
    train = upload(client, tsv_bytes(sentiment_rows(4))).json()["id"]
    dev = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    hyper = {"epochs": 6, "batch_size": 8, "learning_rate": 5e-3, "warmup_ratio": 0.1, "max_length": 32,
             "eval_steps": 4, **hp}
    response = client.post("/jobs", json=job_body(train, dev, base_model=str(tiny_bert), hyperparameters=hyper))
    assert response.status_code == 201, response.text
    return response.json()["id"]


def test_job_runs_to_success_and_serves_predictions(client, queue, runner, tiny_bert, ctx):
    job_id = _submit(client, tiny_bert)
    assert runner.run_training_job(job_id) == "succeeded"
    job = client.get(f"/jobs/{job_id}").json()
    assert job["status"] == "succeeded", job["error"]
    assert job["progress"]["step"] == job["progress"]["total_steps"] == 36  # 48 rows / 8 per batch * 6 epochs
    assert job["progress"]["fraction"] == 1.0
    assert {"train_loss", "learning_rate", "samples_per_second", "eval_loss", "eval_accuracy",
            "eval_f1"} <= set(job["metrics"])
    assert job["metrics"]["eval_accuracy"] == 1.0
    assert job["device"] == "cpu" or job["device"].startswith("cuda")
    assert job["started_at"] and job["finished_at"]
    kinds = [a["kind"] for a in job["artifacts"]]
    assert "model" in kinds
    history = client.get(f"/jobs/{job_id}/metrics").json()["data"]
    losses = [p for p in history if p["name"] == "train_loss"]
    assert [p["step"] for p in losses] == list(range(1, 37))
    evals = [p["step"] for p in history if p["name"] == "eval_accuracy"]
    assert evals[:4] == [4, 8, 12, 16] and evals[-1] == 36
    events = [e["kind"] for e in client.get(f"/jobs/{job_id}/events").json()["data"]]
    assert events[0] == "created" and "started" in events and events[-1] == "succeeded"

    model = next(a for a in job["artifacts"] if a["kind"] == "model")
    assert "manifest.json" in model["files"] and "model.safetensors" in model["files"]
    download = client.get(model["download_url"])
    assert download.status_code == 200 and download.headers["content-type"] == "application/x-tar"

    from worker.servers.classification import serve_classify

    queue.handlers[TASK_CLASSIFY] = lambda payload: serve_classify(ctx, payload)
    response = client.post("/classify", json={"model": job_id, "texts": ["a wonderful , moving film",
                                                                          "a dull , lifeless mess"]})
    assert response.status_code == 200, response.text
    predictions = response.json()["predictions"]
    assert [p["label"] for p in predictions] == [1, 0]
    assert all(0.5 < p["score"] <= 1.0 for p in predictions)


def test_redelivered_task_for_a_finished_job_does_nothing(client, runner, tiny_bert):
    job_id = _submit(client, tiny_bert, epochs=1)
    assert runner.run_training_job(job_id) == "succeeded"
    assert runner.run_training_job(job_id) == "skipped"
    assert client.get(f"/jobs/{job_id}").json()["attempts"] == 1


def test_cancel_while_running_stops_within_a_step_and_keeps_a_checkpoint(client, runner, tiny_bert):
    job_id = _submit(client, tiny_bert, epochs=50, eval_steps=None)
    outcome: dict[str, str] = {}
    thread = threading.Thread(target=lambda: outcome.update(status=runner.run_training_job(job_id)))
    thread.start()
    deadline = time.monotonic() + 60
    while client.get(f"/jobs/{job_id}").json()["progress"]["step"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.post(f"/jobs/{job_id}/cancel").status_code == 200
    thread.join(60)
    assert outcome["status"] == "cancelled"
    job = client.get(f"/jobs/{job_id}").json()
    assert job["status"] == "cancelled" and job["progress"]["step"] < job["progress"]["total_steps"]
    assert any(a["kind"] == "checkpoint" for a in job["artifacts"])


def test_missing_dataset_fails_with_a_clear_error(client, runner, tiny_bert, settings):
    job_id = _submit(client, tiny_bert, epochs=1)
    from core.db import make_engine, make_sessionmaker, session_scope
    from core.store import jobs as store

    engine = make_engine(settings.resolved_database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        store.get_job(session, job_id=job_id).train_dataset_id = None
    engine.dispose()
    assert runner.run_training_job(job_id) == "failed"
    job = client.get(f"/jobs/{job_id}").json()
    assert job["error"]["code"] == "dataset_missing"


def test_out_of_memory_at_one_example_fails_the_job_with_code_oom(client, runner, tiny_bert, monkeypatch):
    import torch

    from worker.engines.training import loop

    def step(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(loop, "train_step", step)
    job_id = _submit(client, tiny_bert, epochs=1)
    assert runner.run_training_job(job_id) == "failed"
    job = client.get(f"/jobs/{job_id}").json()
    assert job["error"]["code"] == "oom" and "one example" in job["error"]["message"]
    assert "tensorboard" in [a["kind"] for a in job["artifacts"]]  # a failed run's curves stay downloadable
    assert "oom" in [e["kind"] for e in client.get(f"/jobs/{job_id}/events").json()["data"]]


def test_freeze_word_embeddings_reaches_the_engine(client, runner, tiny_bert, settings):
    import safetensors.torch

    from core.paths import job_model_dir

    job_id = _submit(client, tiny_bert, epochs=1, freeze_word_embeddings=True)
    assert runner.run_training_job(job_id) == "succeeded"
    table = "bert.embeddings.word_embeddings.weight"
    before = safetensors.torch.load_file(str(tiny_bert / "model.safetensors"))[table]
    model_dir = job_model_dir(settings, job_id)
    after = safetensors.torch.load_file(str(model_dir / "model.safetensors"))[table]
    assert after.equal(before)
    manifest = client.get(f"/jobs/{job_id}").json()
    assert manifest["hyperparameters"]["freeze_word_embeddings"] is True


def test_receipt_rerun_and_compare(client, runner, tiny_bert, settings):
    dataset = upload(client, tsv_bytes(sentiment_rows(2))).json()
    body = job_body(dataset["id"], base_model=str(tiny_bert),
                    hyperparameters={"max_steps": 3, "batch_size": 8, "max_length": 16, "seed": 7})
    original = client.post("/jobs", json=body).json()
    assert original["receipt"] is None and original["queue_position"] == 1
    assert runner.run_training_job(original["id"]) == "succeeded"
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
    assert runner.run_training_job(again["id"]) == "succeeded"
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
