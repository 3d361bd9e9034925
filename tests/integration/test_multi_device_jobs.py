"""A devices=2 job through a real worker that owns two CPU "devices" (two gloo processes under torchrun)."""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from tests.integration.conftest import submit_job, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_two_device_job_is_preempted_resumed_and_finishes_as_one_job(live_client, start_worker, tiny_bert_dir):
    worker = start_worker("training", devices=2)
    job_id = submit_job(live_client, tiny_bert_dir, devices=2, epochs=1, max_steps=40, eval_steps=None)

    def job():
        return live_client.get(f"/jobs/{job_id}").json()

    wait_for(lambda: job()["progress"]["step"] >= 7, 180, "a few steps on two processes")
    assert job()["device"] == "cpu x2"
    worker.send_signal(signal.SIGTERM)  # warm shutdown: rank 0 hears it through should_stop, checkpoints
    assert worker.wait(90) == 0
    assert job()["status"] == "queued"
    start_worker("training", devices=2)
    done = wait_for(lambda: (j := job())["status"] in ("succeeded", "failed") and j, 180, "the resumed job")
    assert done["status"] == "succeeded", done["error"]
    assert done["progress"]["step"] == 40 and done["attempts"] == 2 and done["devices"] == 2
    events = live_client.get(f"/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    started = [e["message"] for e in events if e["kind"] == "started"]
    assert len(started) == 2 and "resumed from checkpoint at step" in started[1]
    history = live_client.get(f"/jobs/{job_id}/metrics", params={"name": "train_loss"}).json()["data"]
    steps = Counter(p["step"] for p in history)  # one metric history: every step once, from rank 0 only
    assert sorted(steps) == list(range(1, 41)) and max(steps.values()) == 1
