"""POST /jobs to succeeded through a real Celery worker process, Redis and PostgreSQL."""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from tests.integration.conftest import submit_job, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_job_succeeds_on_a_real_worker_and_serves_predictions(live_client, start_worker, tiny_bert_dir):
    start_worker("training")
    start_worker("inference", device="auto")
    job_id = submit_job(live_client, tiny_bert_dir)
    seen_steps = set()

    def finished():
        job = live_client.get(f"/jobs/{job_id}").json()
        seen_steps.add(job["progress"]["step"])
        return job if job["status"] in ("succeeded", "failed", "cancelled") else None

    job = wait_for(finished, 180, "the job to finish")
    assert job["status"] == "succeeded", job["error"]
    assert job["metrics"]["eval_accuracy"] == 1.0
    assert len(seen_steps) >= 2  # progress was visible while it ran
    response = live_client.post("/classify", json={"model": job_id, "texts": ["i loved every minute",
                                                                               "boring and far too long"]})
    assert response.status_code == 200, response.text
    assert [p["label"] for p in response.json()["predictions"]] == [1, 0]


def test_worker_shutdown_requeues_and_the_next_worker_resumes(live_client, start_worker, tiny_bert_dir):
    worker = start_worker("training")
    job_id = submit_job(live_client, tiny_bert_dir, epochs=1, max_steps=150, eval_steps=None)
    wait_for(lambda: live_client.get(f"/jobs/{job_id}").json()["progress"]["step"] >= 7, 120, "a few steps")
    worker.send_signal(signal.SIGTERM)  # warm shutdown: checkpoint, requeue, exit
    assert worker.wait(60) == 0
    assert live_client.get(f"/jobs/{job_id}").json()["status"] == "queued"
    start_worker("training")
    job = wait_for(lambda: (j := live_client.get(f"/jobs/{job_id}").json())["status"] == "succeeded" and j,
                   180, "the resumed job to succeed")
    assert job["progress"]["step"] == 150 and job["attempts"] == 2
    events = live_client.get(f"/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    kinds = [e["kind"] for e in events]
    assert "preempted" in kinds
    started = [e["message"] for e in events if e["kind"] == "started"]
    assert len(started) == 2 and "resumed from checkpoint at step" in started[1]
    history = live_client.get(f"/jobs/{job_id}/metrics", params={"name": "train_loss"}).json()["data"]
    steps = Counter(p["step"] for p in history)
    assert sorted(steps) == list(range(1, 151)) and max(steps.values()) == 1
