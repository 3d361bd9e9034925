"""A job's TensorBoard events and worker metrics, from the runner in-process (real rows, a tiny real BERT)."""

from __future__ import annotations

import io
import tarfile

import pytest

from tests.factories import job_body, sentiment_rows, tsv_bytes, upload
from tests.tiny_models import build_tiny_bert


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-tb") / "bert")


def test_event_files_hold_the_train_loss_and_download_with_the_artifacts(client, settings, queue, tiny_bert,
                                                                        tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from worker import metrics
    from worker.context import WorkerContext
    from worker.jobs.lifecycle import run_training_job

    train = upload(client, tsv_bytes(sentiment_rows(2))).json()["id"]
    hyper = {"max_steps": 6, "batch_size": 8, "learning_rate": 1e-2, "max_length": 32, "eval_steps": 3,
             "precision": "fp32"}
    job_id = client.post("/jobs", json=job_body(train, train, base_model=str(tiny_bert),
                                                hyperparameters=hyper)).json()["id"]
    steps_before = metrics.REGISTRY.get_sample_value("trainserve_training_steps_total", {"device": "cpu"}) or 0
    ctx = WorkerContext(settings, queue)
    try:
        assert run_training_job(ctx, job_id) == "succeeded"
    finally:
        ctx.close()

    job = client.get(f"/jobs/{job_id}").json()
    board = next(a for a in job["artifacts"] if a["kind"] == "tensorboard")
    assert any(name.startswith("events.out.tfevents.") for name in board["files"])
    archive = client.get(board["download_url"])
    assert archive.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
        tar.extractall(tmp_path / "tb", filter="data")
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    assert {"train/train_loss", "train/learning_rate", "eval/loss", "eval/accuracy"} <= set(events.Tags()["scalars"])
    loss = events.Scalars("train/train_loss")
    history = client.get(f"/jobs/{job_id}/metrics", params={"name": "train_loss"}).json()["data"]
    assert [e.step for e in loss] == [p["step"] for p in history] == list(range(1, 7))
    assert [e.value for e in loss] == pytest.approx([p["value"] for p in history], rel=1e-6)
    assert [e.step for e in events.Scalars("eval/loss")] == [3, 6]

    # The same callbacks fed the worker's Prometheus families.
    assert metrics.REGISTRY.get_sample_value("trainserve_training_steps_total", {"device": "cpu"}) == \
        steps_before + 6
    assert metrics.REGISTRY.get_sample_value("trainserve_training_samples_per_second", {"device": "cpu"}) > 0
    assert metrics.REGISTRY.get_sample_value("trainserve_device_memory_bytes", {"device": "cpu"}) > 0
    assert metrics.REGISTRY.get_sample_value("trainserve_job_duration_seconds_count",
                                             {"task": "text-classification", "status": "succeeded"}) >= 1
    assert metrics.REGISTRY.get_sample_value("trainserve_worker_jobs_running") == 0
