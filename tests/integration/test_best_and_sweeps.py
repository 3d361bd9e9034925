"""Best checkpoints, early stopping and sweeps through real worker processes, Redis and PostgreSQL."""

from __future__ import annotations

import math

import pytest

from tests.factories import job_body, tsv_bytes, upload
from tests.integration.conftest import wait_for
from tests.unit.test_engine_training import NEGATIVE, POSITIVE

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROWS = ([(t, "pos") for t in POSITIVE] + [(t, "neg") for t in NEGATIVE]) * 4  # 32 rows: 4 steps of 8 an epoch


def test_an_early_stopped_job_serves_its_best_checkpoint(live_client, settings, start_worker, tiny_bert_dir):
    settings.classify_timeout_s = 600  # the first /classify loads the model: slow on a loaded machine
    start_worker("training")
    start_worker("inference", device="auto")
    data = upload(live_client, tsv_bytes(ROWS)).json()["id"]
    # The learning rate warms up over 24 steps to 0.05, far too high for AdamW: the tiny BERT learns the task
    # while the rate is still small (accuracy 1.0 by step 10), then the growing steps wreck it and eval_loss
    # climbs. Seeded, fp32 and on a CPU: the same numbers every run (best at step 16, stopped at 20 here).
    hyper = {"max_steps": 30, "batch_size": 8, "learning_rate": 0.05, "warmup_ratio": 0.8, "seed": 3,
             "eval_steps": 2, "metric_for_best": "eval_loss", "early_stopping_patience": 2, "precision": "fp32"}
    response = live_client.post("/jobs", json=job_body(data, data, base_model=str(tiny_bert_dir),
                                                       hyperparameters=hyper))
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    job = wait_for(lambda: (j := live_client.get(f"/jobs/{job_id}").json())["status"] in (
        "succeeded", "failed", "cancelled") and j, 600, "the job to finish")
    assert (job["status"], job["stop_reason"]) == ("succeeded", "early_stopping"), job["error"]
    best, stopped_at = job["best"], job["progress"]["step"]
    assert best["metric"] == "eval_loss" and best["step"] < stopped_at < 30

    # The checkpoint list shows why: the best, then two evaluations that did not beat it.
    listing = live_client.get(f"/jobs/{job_id}/checkpoints").json()
    checkpoints = {c["step"]: c for c in listing["data"]}
    assert sorted(checkpoints) == list(range(2, stopped_at + 1, 2)) and listing["best"] == best
    assert [c["step"] for c in listing["data"] if c["is_best"]] == [best["step"]]
    best_checkpoint = checkpoints[best["step"]]
    assert best_checkpoint["metrics"]["eval_loss"] == best["value"] and best_checkpoint["download_url"]
    after = [c["metrics"]["eval_loss"] for step, c in checkpoints.items() if step > best["step"]]
    assert len(after) == 2 and min(after) >= best["value"]
    assert min(c["metrics"]["eval_loss"] for c in checkpoints.values()) == best["value"]
    assert best_checkpoint["metrics"]["eval_accuracy"] >= 0.75  # it had learned before the rate wrecked it
    events = live_client.get(f"/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    assert "early_stopping" in [e["kind"] for e in events]
    tar = live_client.get(best_checkpoint["download_url"])
    assert tar.status_code == 200 and b"model.safetensors" in tar.content

    # /classify answers with the best step's weights: its cross-entropy on the eval rows is the best's eval_loss,
    # not that of the last evaluation.
    texts, labels = POSITIVE + NEGATIVE, ["pos"] * len(POSITIVE) + ["neg"] * len(NEGATIVE)
    response = live_client.post("/classify", json={"model": job_id, "texts": texts})
    assert response.status_code == 200, response.text
    predictions = response.json()["predictions"]
    loss = -sum(math.log(p["score"] if p["label"] == y else 1 - p["score"])
                for p, y in zip(predictions, labels, strict=True)) / len(labels)
    assert loss == pytest.approx(best["value"], rel=1e-3, abs=1e-4)
    assert loss != pytest.approx(checkpoints[stopped_at]["metrics"]["eval_loss"], rel=1e-2)
    accuracy = sum(p["label"] == y for p, y in zip(predictions, labels, strict=True)) / len(labels)
    assert accuracy == best_checkpoint["metrics"]["eval_accuracy"]


def test_a_random_sweep_names_its_best_child_and_prunes_the_laggards(live_client, start_worker, tiny_bert_dir):
    start_worker("training")
    data = upload(live_client, tsv_bytes(ROWS)).json()["id"]
    base = job_body(data, data, base_model=str(tiny_bert_dir),
                    hyperparameters={"max_steps": 12, "batch_size": 8, "eval_steps": 4, "seed": 3, "precision": "fp32"})
    # Seed 2 draws learning rates 1e-2, 1e-5, 1e-5, 1e-2 in that order: by step 8 the 1e-2 children's eval_loss
    # has started to fall while the 1e-5 ones have barely moved, so the median rule stops those at step 8.
    spec = {"job": base, "method": "random", "count": 4, "seed": 2, "parallelism": 2,
            "parameters": {"learning_rate": {"values": [1e-2, 1e-5]}, "weight_decay": {"low": 0.0, "high": 0.1}},
            "pruning": {"min_evaluations": 2, "min_trials": 1}}
    response = live_client.post("/sweeps", json=spec, headers={"Idempotency-Key": "sweep-it"})
    assert response.status_code == 201, response.text
    sweep_id = response.json()["id"]
    assert [t["params"]["learning_rate"] for t in response.json()["trials"]] == [1e-2, 1e-5, 1e-5, 1e-2]
    most_active = 0

    def finished():
        nonlocal most_active
        sweep = live_client.get(f"/sweeps/{sweep_id}").json()
        most_active = max(most_active, sum(t["status"] in ("queued", "running") for t in sweep["trials"]))
        return sweep if sweep["status"] != "running" else None

    sweep = wait_for(finished, 900, "the sweep to finish")
    assert sweep["status"] == "succeeded" and most_active <= 2
    trials = sweep["trials"]
    assert all(t["status"] == "succeeded" and t["best"] is not None for t in trials), trials
    pruned = [t for t in trials if t["stop_reason"] == "pruned"]
    assert {t["index"] for t in pruned} >= {1, 2}  # the 1e-5 children (a 1e-2 one may be pruned later too)
    assert all(t["best"]["step"] <= 8 for t in trials if t["index"] in (1, 2))
    winner = min(trials, key=lambda t: t["best"]["value"])
    assert sweep["best"]["job_id"] == winner["job_id"] and winner["params"]["learning_rate"] == 1e-2
    assert sweep["best"]["value"] == winner["best"]["value"]
    events = live_client.get(f"/jobs/{pruned[0]['job_id']}/events", params={"limit": 1000}).json()["data"]
    assert any(e["kind"] == "pruned" and "median" in e["message"] for e in events)
