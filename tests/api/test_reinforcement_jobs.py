"""Reinforcement fine-tuning jobs through OpenAI's API: prompts files, the method's shape, graders validated at
submission (a bad or unreachable grader is a 422 naming the field)."""

from __future__ import annotations

import json

import openai
import pytest

from core import capacity
from core.adapters import AdapterConfig
from core.chat_data import longest_tokens
from core.db import make_engine, make_sessionmaker, session_scope
from core.estimate import adapter_parameter_count, architecture, load_model_config, training_memory
from core.redis_client import redis_from_url
from core.rows import Dataset
from tests.api.test_openai_platform import _api
from tests.tiny_chat import QUESTIONS, chat_jsonl

GRADER = {"type": "string_check", "name": "has answer", "input": "{{sample.output_text}}",
          "reference": "{{item.answer}}", "operation": "like"}


def prompts_jsonl() -> bytes:
    """A prompts dataset: user questions, each with the field its grader reads (item.answer)."""
    return b"".join(json.dumps({"messages": [{"role": "user", "content": q}], "answer": "1"}).encode() + b"\n"
                    for q in QUESTIONS)


@pytest.fixture()
def api(client):
    return _api(client)


@pytest.fixture()
def prompts_file(api):
    return api.files.create(file=("prompts.jsonl", prompts_jsonl()), purpose="fine-tune")


def _body(tiny_llama_dir, prompts_file, **reinforcement) -> dict:
    return {"model": str(tiny_llama_dir), "training_file": prompts_file.id,
            "method": {"type": "reinforcement", "reinforcement": {"grader": GRADER, **reinforcement}}}


def test_a_reinforcement_job_maps_openais_method_onto_the_spec(api, client, prompts_file, tiny_llama_dir):
    assert client.get(f"/datasets/{prompts_file.id}").json()["format"] == "prompts"
    job = api.fine_tuning.jobs.create(
        model=str(tiny_llama_dir), training_file=prompts_file.id, validation_file=prompts_file.id,
        method={"type": "reinforcement", "reinforcement": {"grader": GRADER, "hyperparameters": {
            "compute_multiplier": 2, "eval_interval": 5, "eval_samples": 3, "n_epochs": 2, "batch_size": 2,
            "reasoning_effort": "default", "beta": 0.1, "loss_type": "dr_grpo", "max_completion_tokens": 8}}})
    assert job.method.type == "reinforcement" and job.status == "queued"
    read = job.method.reinforcement
    assert read.grader.type == "string_check" and read.hyperparameters.compute_multiplier == 2.0
    assert read.hyperparameters.eval_interval == 5 and read.hyperparameters.eval_samples == 3
    row = client.get(f"/jobs/{job.id}").json()
    method = row["method"]
    assert method["method"] == "reinforcement" and method["samples"] == 8 and method["eval_samples"] == 3
    assert method["beta"] == 0.1 and method["loss_type"] == "dr_grpo" and method["max_completion_tokens"] == 8
    assert method["grader"]["reference"] == "{{item.answer}}" and row["adapter"]["method"] == "lora"
    hp = row["hyperparameters"]
    assert hp["eval_steps"] == 5 and hp["epochs"] == 2 and hp["batch_size"] == 2
    assert hp["metric_for_best"] == "eval_reward"


def test_post_jobs_takes_the_method_and_full_weights_without_a_kl_penalty(client, prompts_file, tiny_llama_dir):
    body = {"task": "causal-lm", "base_model": str(tiny_llama_dir), "train_dataset": prompts_file.id,
            "method": {"method": "reinforcement", "grader": GRADER, "beta": 0}}
    response = client.post("/jobs", json=body)
    assert response.status_code in (200, 201, 202), response.text
    assert response.json()["adapter"] is None
    response = client.post("/jobs", json={**body, "method": {"method": "reinforcement", "grader": GRADER}})
    assert response.status_code == 422 and response.json()["error"]["field"] == "adapter", response.text
    response = client.post("/jobs", json={**body, "hyperparameters": {"metric_for_best": "eval_loss"}})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == "hyperparameters.metric_for_best", response.text


@pytest.mark.parametrize(("reinforcement", "param", "words"), [
    ({"grader": {"type": "python", "name": "p", "source": "def grade(s, i): return 1"}},
     "method.reinforcement.grader.python", "python graders are not supported"),
    ({"grader": {**GRADER, "operation": "regex"}}, "method.reinforcement.grader.string_check.operation", "eq"),
    ({"grader": {"type": "score_model", "name": "judge", "model": "m",
                 "input": [{"role": "user", "content": "{{sample.output_text}}"}]}},
     "method.reinforcement.grader", "served judge model"),
    ({"grader": {"type": "multi", "name": "m", "calculate_output": "a", "graders": {"a": {
        "type": "text_similarity", "name": "a", "input": "x", "reference": "y", "evaluation_metric": "cosine"}}}},
     "method.reinforcement.grader", "embeddings model"),
    ({"grader": GRADER, "hyperparameters": {"reasoning_effort": "high"}},
     "method.reinforcement.hyperparameters.reasoning_effort", "reasoning effort"),
    ({"grader": GRADER, "hyperparameters": {"compute_multiplier": 0}},
     "method.reinforcement.hyperparameters.compute_multiplier", "auto"),
    ({"grader": GRADER, "hyperparameters": {"loss_type": "ppo"}},
     "method.reinforcement.hyperparameters.loss_type", "grpo"),
])
def test_a_bad_grader_or_setting_is_a_422_naming_the_field(client, prompts_file, tiny_llama_dir, reinforcement,
                                                           param, words):
    body = _body(tiny_llama_dir, prompts_file)
    body["method"]["reinforcement"] = reinforcement
    response = client.post("/v1/fine_tuning/jobs", json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_data_and_method_must_match(api, client, prompts_file, tiny_llama_dir):
    chat = api.files.create(file=("chat.jsonl", chat_jsonl("Four.")), purpose="fine-tune")
    response = client.post("/v1/fine_tuning/jobs", json={**_body(tiny_llama_dir, prompts_file),
                                                         "training_file": chat.id})
    assert response.status_code == 422 and response.json()["error"]["param"] == "training_file"
    response = client.post("/v1/fine_tuning/jobs", json={"model": str(tiny_llama_dir),
                                                         "training_file": prompts_file.id})
    assert response.status_code == 422 and response.json()["error"]["param"] == "training_file"
    assert "reinforcement" in response.json()["error"]["message"]
    with pytest.raises(openai.UnprocessableEntityError) as bad:
        api.files.create(file=("p.jsonl", prompts_jsonl() + b'{"messages": [{"role": "user", "content": "x", '
                                                            b'"weight": 1}]}\n'), purpose="fine-tune")
    assert bad.value.body["message"].startswith("line 7: messages[0].weight")


def test_admission_counts_every_sampled_row(client, settings, prompts_file, tiny_llama_dir):
    """A prompt trains `samples` rows of prompt + answer: what fits for one row per prompt may not for 64."""
    arch = architecture(load_model_config(str(tiny_llama_dir)))
    lora = AdapterConfig()
    trainable = adapter_parameter_count(arch, lora.r, lora.target_modules)

    def estimate(rows: int, seq_len: int) -> int:
        # what admission falls back to at worst: the chunked loss and gradient checkpointing
        return training_memory(arch, head="causal-lm", batch_size=rows, seq_len=seq_len, precision="fp32",
                               trainable=trainable, chunked_loss=True, checkpointing=True).total_bytes

    # The prompts' token bound plus the answers, within the tiny Llama's 256 positions: 8 x 2 rows of prompt + 32
    # vs 8 x 64 rows of the whole context, many times the activations; the device sits between.
    with session_scope(make_sessionmaker(engine := make_engine(settings.resolved_database_url))) as session:
        prompt = min(longest_tokens(session.get(Dataset, prompts_file.id).column_stats), 256)
    engine.dispose()
    limit = int((estimate(8 * 2, prompt + 32) * estimate(8 * 64, 256)) ** 0.5)
    board = redis_from_url(settings.resolved_redis_url)
    capacity.publish(board, capacity.DeviceCapacity(worker="small:1", device="cpu", total_bytes=limit), ttl_s=60)
    try:
        body = {"task": "causal-lm", "base_model": str(tiny_llama_dir), "train_dataset": prompts_file.id,
                "adapter": {}, "method": {"method": "reinforcement", "grader": GRADER, "samples": 2}}
        assert client.post("/jobs", json=body).status_code == 201
        body["method"].update(samples=64, max_completion_tokens=256 - prompt)
        response = client.post("/jobs", json=body)
        assert response.status_code == 422 and response.json()["error"]["code"] == "does_not_fit", response.text
    finally:
        capacity.withdraw(board, "small:1")
        board.close()


def _multi(count: int) -> dict:
    graders = {f"g{i}": {**GRADER, "name": f"g{i}"} for i in range(count)}
    return {"type": "multi", "name": "many", "calculate_output": "g0", "graders": graders}


@pytest.mark.parametrize(("reinforcement", "param", "words"), [
    ({"grader": GRADER, "hyperparameters": {"eval_samples": 9}},
     "method.reinforcement.hyperparameters.eval_samples", "at most 8"),
    ({"grader": GRADER, "hyperparameters": {"compute_multiplier": 4}},  # 16 samples per prompt
     "method.reinforcement.hyperparameters.compute_multiplier", "at most 8"),
    ({"grader": _multi(33)}, "method.reinforcement.grader.graders", "at most 32"),
    # tiny Llama: 256 positions; a prompt of a few tokens and 4,000 more cannot be sampled
    ({"grader": GRADER, "hyperparameters": {"max_completion_tokens": 4000}},
     "method.reinforcement.hyperparameters.max_completion_tokens", "context of 256"),
])
def test_a_job_past_a_reinforcement_bound_is_a_422_naming_the_field(client, settings, prompts_file, tiny_llama_dir,
                                                                    reinforcement, param, words):
    settings.reinforcement_max_samples = 8
    body = _body(tiny_llama_dir, prompts_file)
    body["method"]["reinforcement"] = reinforcement
    response = client.post("/v1/fine_tuning/jobs", json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert client.get("/v1/fine_tuning/jobs").json()["data"] == []  # nothing written
    body["method"]["reinforcement"]["grader"] = _multi(32)
    hp = body["method"]["reinforcement"].setdefault("hyperparameters", {})
    hp.update(eval_samples=8, compute_multiplier=2, max_completion_tokens=64)  # at the bounds: admitted
    assert client.post("/v1/fine_tuning/jobs", json=body).status_code in (200, 201), body
