"""Reinforcement fine-tuning on a real training worker through the official `openai` client: a tiny Llama learns
to answer with the digit its prompts name (string_check on item.answer); its validation reward rises clearly,
and each step's reward, KL and completion length are in the job's metric history (what the dashboard charts)."""

from __future__ import annotations

import openai
import pytest

from tests.api.test_reinforcement_jobs import GRADER, prompts_jsonl
from tests.integration.test_lora_jobs import _finished

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def test_rft_through_the_official_client_raises_the_validation_reward(live_client, start_worker, tiny_llama_dir):
    start_worker("training")
    api = openai.OpenAI(base_url="http://testserver/v1", api_key=live_client.headers["Authorization"].split()[1],
                        http_client=live_client, max_retries=0)
    train = api.files.create(file=("prompts.jsonl", prompts_jsonl()), purpose="fine-tune")
    job = api.fine_tuning.jobs.create(
        model=str(tiny_llama_dir), training_file=train.id, validation_file=train.id, seed=0,
        method={"type": "reinforcement", "reinforcement": {"grader": GRADER, "hyperparameters": {
            "compute_multiplier": 2, "eval_interval": 4, "eval_samples": 8, "batch_size": 3,
            "learning_rate_multiplier": 2e-2 / 3e-4, "weight_decay": 0, "max_steps": 16, "max_completion_tokens": 4,
            "precision": "fp32"}}},
        extra_body={"adapter": {"r": 8, "alpha": 16, "dropout": 0.0}})
    row = _finished(live_client, job.id)
    assert row["status"] == "succeeded", row.get("error")
    finished = api.fine_tuning.jobs.retrieve(job.id)
    assert finished.status == "succeeded" and finished.fine_tuned_model == job.id
    events = list(api.fine_tuning.jobs.list_events(job.id, limit=100))
    assert any(e.type == "metrics" and "eval_reward" in (e.data or {}) for e in events)
    started = next(e for e in events if e.data and "eval_reward_at_start" in e.data)
    history = live_client.get(f"/jobs/{job.id}/metrics").json()["data"]
    by_name: dict[str, dict[int, float]] = {}
    for point in history:
        by_name.setdefault(point["name"], {})[point["step"]] = point["value"]
    curve = {0: started.data["eval_reward_at_start"], **by_name["eval_reward"]}
    print("validation reward by step:", {step: round(value, 3) for step, value in sorted(curve.items())})
    print("train reward by step:", {s: round(v, 3) for s, v in sorted(by_name["reward_mean"].items())})
    assert curve[0] < 0.3 and curve[16] >= 0.75 and curve[16] - curve[0] >= 0.5, curve
    for name in ("reward_mean", "reward_std", "kl", "clip_fraction", "completion_length", "train_loss"):
        assert len(by_name[name]) == 16, name
    kept = api.fine_tuning.jobs.checkpoints.list(job.id).data  # the kept evaluations, with their rewards
    assert kept and all(c.metrics.model_dump()["eval_reward"] in curve.values() for c in kept)
