"""A warm shutdown of a real Celery worker process requeues its job, and the next worker resumes it.

(A job trained on a worker process and served by another: tests/integration/test_compose_processes.py.)
"""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from tests.integration.conftest import submit_job, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


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
