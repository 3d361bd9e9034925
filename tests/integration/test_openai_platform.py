"""The whole OpenAI fine-tuning loop with the official client against real processes (the API and both workers):
upload a chat file, fine-tune a tiny Llama in full, poll, read events and checkpoints, chat with the result."""

from __future__ import annotations

import shutil
import time

import httpx
import openai
import pytest

from tests.conftest import INTEGRATION_REDIS, make_key
from tests.service import started_service
from tests.tiny_chat import chat_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]
TERMINAL = ("succeeded", "failed", "cancelled")


def test_upload_fine_tune_poll_events_checkpoints_and_chat(pg_url, tmp_path, tiny_llama_dir):
    home = tmp_path / "home"
    shutil.copytree(tiny_llama_dir, home / "models" / "tiny-llama")
    with started_service(pg_url, INTEGRATION_REDIS, home, tmp_path, TRAINSERVE_GENERATION_PRECISION="fp32") as base:
        api = openai.OpenAI(base_url=f"{base}/v1", api_key=make_key(pg_url, tenant="openai"), max_retries=0,
                            timeout=120)
        training = api.files.create(file=("blue.jsonl", chat_jsonl("Blue.", repeat=4)), purpose="fine-tune")
        validation = api.files.create(file=("blue-eval.jsonl", chat_jsonl("Blue.")), purpose="fine-tune")
        job = api.fine_tuning.jobs.create(
            model="tiny-llama", training_file=training.id, validation_file=validation.id, suffix="blue", seed=3,
            method={"type": "supervised", "supervised": {"hyperparameters": {
                "n_epochs": "auto", "batch_size": 4, "learning_rate_multiplier": 30,
                # trainserve's own hyperparameters, by their names: a short run with two evaluations
                "max_steps": 30, "eval_steps": 15, "precision": "fp32", "block_size": 128}}})
        assert job.status == "queued" and job.user_provided_suffix == "blue" and job.seed == 3

        deadline = time.monotonic() + 420
        while (job := api.fine_tuning.jobs.retrieve(job.id)).status not in TERMINAL:
            assert time.monotonic() < deadline, f"job {job.id} still {job.status}"
            time.sleep(2)
        assert job.status == "succeeded", job.error
        assert job.fine_tuned_model == job.id and job.finished_at and job.trained_tokens and job.trained_tokens > 0
        assert job.hyperparameters.learning_rate_multiplier == 30 and job.hyperparameters.batch_size == 4

        headers = {"Authorization": f"Bearer {api.api_key}"}
        events = list(api.fine_tuning.jobs.list_events(job.id, limit=5))  # every page, newest first
        own_events = httpx.get(f"{base}/jobs/{job.id}/events", params={"limit": 1000}, headers=headers).json()
        assert [e.message for e in events] == [e["message"] for e in reversed(own_events["data"])]
        assert any(e.type == "metrics" for e in events) and own_events["data"][-1]["kind"] == "succeeded"
        checkpoints = api.fine_tuning.jobs.checkpoints.list(job.id).data
        assert [c.step_number for c in checkpoints] == [30, 15]
        best = [c for c in checkpoints if c.fine_tuned_model_checkpoint == job.id]
        assert len(best) == 1 and best[0].metrics.valid_loss is not None

        assert job.fine_tuned_model in [m.id for m in api.models.list()]
        reply = api.chat.completions.create(model=job.fine_tuned_model, max_tokens=8, temperature=0,
                                            messages=[{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "What colour is the sky?"}])
        assert reply.choices[0].message.content.strip().startswith("Blue"), reply
        completion = api.completions.create(model=job.fine_tuned_model, prompt="The sky is", max_tokens=4)
        assert completion.model == job.id and completion.usage.completion_tokens > 0
        # The same job through trainserve's own API.
        own = httpx.get(f"{base}/jobs/{job.id}", headers=headers).json()
        assert own["status"] == "succeeded" and own["train_dataset"] == training.id
