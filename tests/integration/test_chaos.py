"""Chaos under `trainserve up`: training workers SIGKILLed at random moments, mid-checkpoint, and by a poison job.

Written against behaviour only (HTTP API, events, files, /proc), so the lifecycle code may change beneath it.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from tests.factories import sentiment_rows, tsv_bytes
from tests.integration.conftest import wait_for
from tests.integration.test_local_mode import _training_worker, _up

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(480)]

CHECKPOINT_STEPS = 5  # many short-lived checkpoint folders: a busy CPU still lets the test catch one mid-write
MAX_ATTEMPTS = 3  # the chaos job is killed twice and succeeds on its 3rd run; the poison job dies 3 times


def _job(api, job_id: str) -> dict:
    return api.get(f"/jobs/{job_id}").json()


def _events(api, job_id: str) -> list[dict]:
    return api.get(f"/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]


def _running_attempt(api, job_id: str, attempt: int) -> dict | bool:
    """The job once attempt `attempt` has started training (its `started` event is written), else False."""
    job = _job(api, job_id)
    assert job["status"] not in ("failed", "cancelled"), job
    started = [e for e in _events(api, job_id) if e["kind"] == "started"]
    return job["status"] == "running" and job["attempts"] == attempt and len(started) >= attempt and job


def _kill_during_checkpoint_write(checkpoints: Path, up_pid: int, timeout: float = 60) -> bool:
    """SIGKILL the training worker as soon as a checkpoint's temporary folder appears; True if caught mid-write."""
    deadline = time.monotonic() + timeout
    victim = _training_worker(up_pid)
    while time.monotonic() < deadline:
        try:
            names = [entry.name for entry in os.scandir(checkpoints)]
        except FileNotFoundError:
            names = []
        if any(name.startswith(".tmp-checkpoint-") for name in names):
            os.kill(victim, signal.SIGKILL)
            time.sleep(0.2)
            return any(p.name.startswith(".tmp-checkpoint-") for p in checkpoints.iterdir())
    raise AssertionError("no checkpoint was written in time")


def test_poison_job_fails_with_worker_lost_and_a_chaos_job_succeeds_once(tmp_path, tiny_bert_dir):
    rng = random.Random(os.environ.get("TRAINSERVE_CHAOS_SEED", "7"))
    home = tmp_path / "home"
    proc, api = _up(home, tmp_path / "up.log", TRAINSERVE_CHECKPOINT_STEPS=str(CHECKPOINT_STEPS),
                    TRAINSERVE_HEARTBEAT_TIMEOUT_S="4", TRAINSERVE_MAX_ATTEMPTS=str(MAX_ATTEMPTS))
    try:
        ds = api.post("/datasets", files={"file": ("train.tsv", tsv_bytes(sentiment_rows(4)))}).json()["id"]

        def create(max_steps: int) -> str:
            body = {"base_model": str(tiny_bert_dir), "train_dataset": ds, "text_column": "sentence",
                    "label_column": "label", "hyperparameters": {"max_steps": max_steps, "batch_size": 8,
                                                                 "learning_rate": 1e-2, "max_length": 32}}
            response = api.post("/jobs", json=body)
            assert response.status_code == 201, response.text
            return str(response.json()["id"])

        # A poison job: its worker dies every time it runs it (here the test is the poison, so nothing in the
        # service knows). It must fail after MAX_ATTEMPTS runs with worker_lost, not loop forever.
        poison = create(1_000_000)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            wait_for(lambda a=attempt: (j := _job(api, poison))["status"] == "running" and j["attempts"] == a,
                     90, f"poison attempt {attempt}")
            os.kill(_training_worker(proc.pid), signal.SIGKILL)
        failed = wait_for(lambda: (j := _job(api, poison))["status"] in ("failed", "succeeded") and j, 90,
                          "the poison job to fail")
        assert failed["status"] == "failed" and failed["error"]["code"] == "worker_lost", failed
        assert failed["attempts"] == MAX_ATTEMPTS

        # The worker that replaced the last victim serves the next job, which is killed twice more: while a
        # checkpoint is being written, and at a random moment.
        max_steps = 150
        job_id = create(max_steps)
        checkpoints = home / "jobs" / job_id / "checkpoints"
        wait_for(lambda: _running_attempt(api, job_id, 1), 90, "the chaos job to start")
        wait_for(lambda: checkpoints.is_dir() and any(p.name.startswith("checkpoint-") for p in checkpoints.iterdir()),
                 90, "a first complete checkpoint")
        caught_mid_write = False
        for attempt, how in enumerate(("checkpoint", "random"), start=1):
            wait_for(lambda a=attempt: _running_attempt(api, job_id, a), 90, f"attempt {attempt} to train")
            if how == "checkpoint":
                caught_mid_write = _kill_during_checkpoint_write(checkpoints, proc.pid)
            else:  # a random step a little ahead, not a random time: a fast CPU could otherwise finish first
                target = _job(api, job_id)["progress"]["step"] + rng.randint(1, 12)
                wait_for(lambda t=target: _job(api, job_id)["progress"]["step"] >= t, 90, f"step {target}")
                os.kill(_training_worker(proc.pid), signal.SIGKILL)
            assert _job(api, job_id)["status"] != "succeeded", "the job finished before it could be killed"
        done = wait_for(lambda: (j := _job(api, job_id))["status"] in ("succeeded", "failed") and j, 240,
                        "the chaos job to finish")
        assert done["status"] == "succeeded", done["error"]
        assert done["attempts"] == MAX_ATTEMPTS and done["progress"]["step"] == max_steps

        events = _events(api, job_id)
        kinds = [e["kind"] for e in events]
        assert kinds.count("succeeded") == 1 and kinds.count("claimed") == MAX_ATTEMPTS
        started = [e["message"] for e in events if e["kind"] == "started"]
        assert len(started) == MAX_ATTEMPTS
        for message in started[1:]:  # every run after a kill resumed from a checkpoint, never from scratch
            assert "resumed from checkpoint at step" in message and "at step 0" not in message, started
        steps = [p["step"] for p in api.get(f"/jobs/{job_id}/metrics", params={"name": "train_loss"}).json()["data"]]
        assert steps == list(range(1, max_steps + 1))  # unique and gap-free across four runs
        assert [a["kind"] for a in done["artifacts"]].count("model") == 1
        assert not [p for p in checkpoints.glob(".tmp-*")], "a half-written checkpoint was left behind"
        print(f"checkpoint write interrupted mid-way: {caught_mid_write}")
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0
