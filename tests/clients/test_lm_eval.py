"""lm-evaluation-harness 0.4 against a started service: its `local-completions` model scores a local multiple-choice
task through /v1/completions (echo with logprobs over the prompt, token-id prompts in batches) exactly as its own
`hf` model scores it on the same weights in-process: the real SmolLM2 and the tiny Qwen2 (another tokenizer)."""

from __future__ import annotations

import json
import math

import pytest

from tests.clients.conftest import ClientService

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

# Questions whose answers a 135M model knows in part, so the accuracy is neither 0 nor 1 by construction.
QUESTIONS = [
    ("The capital of France is", [" Paris", " Rome", " Berlin", " Madrid"], 0),
    ("Two plus two equals", [" three", " four", " five"], 1),
    ("The sun rises in the", [" west", " north", " east"], 2),
    ("Water freezes at zero degrees", [" Fahrenheit", " Celsius"], 1),
    ("A week has seven", [" days", " months", " years"], 0),
    ("The opposite of hot is", [" warm", " cold", " loud"], 1),
    ("Cats are animals that say", [" woof", " moo", " meow"], 2),
    ("The largest ocean on Earth is the", [" Atlantic", " Pacific", " Indian", " Arctic"], 1),
    ("Bees make", [" milk", " honey", " silk"], 1),
    ("The first month of the year is", [" March", " January", " December"], 1),
]
TASK = """task: trainserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def _evaluate(tasks_dir, model: str, model_args: dict) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=["trainserve_mc"], batch_size=8,
                           task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
                           log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0)


def _scores(results: dict) -> list[list[float]]:
    """Each question's log-likelihood of each choice, in the task's order."""
    samples = sorted(results["samples"]["trainserve_mc"], key=lambda s: s["doc_id"])
    return [[float(resp[0][0]) for resp in sample["resps"]] for sample in samples]


@pytest.mark.parametrize("model", ["smollm2", "tiny-qwen"])
def test_local_completions_scores_a_multiple_choice_task_as_lm_evals_own_hf_model(
        client_service: ClientService, model: str, tmp_path, monkeypatch) -> None:
    folder = client_service.smollm2 if model == "smollm2" else client_service.tool_base
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (tmp_path / "trainserve_mc.yaml").write_text(TASK.format(data=data))
    monkeypatch.setenv("OPENAI_API_KEY", client_service.key)  # local-completions sends it as the bearer token
    served = _evaluate(tmp_path, "local-completions", {
        "model": model, "base_url": f"{client_service.v1}/completions", "tokenizer_backend": "huggingface",
        "tokenizer": str(folder), "tokenized_requests": True, "num_concurrent": 1,
        "max_retries": 1, "timeout": 300})
    reference = _evaluate(tmp_path, "hf", {"pretrained": str(folder), "dtype": "float32", "device": "cpu"})
    served_scores, reference_scores = _scores(served), _scores(reference)
    assert len(served_scores) == len(QUESTIONS)
    for question, got, want in zip(QUESTIONS, served_scores, reference_scores, strict=True):
        assert len(got) == len(question[1])
        assert all(math.isclose(g, w, abs_tol=2e-3) for g, w in zip(got, want, strict=True)), (question, got, want)
    for metric in ("acc,none", "acc_norm,none"):
        assert served["results"]["trainserve_mc"][metric] == reference["results"]["trainserve_mc"][metric], metric
    if model == "smollm2":  # the real model knows something (the tiny one is random)
        assert 0 < served["results"]["trainserve_mc"]["acc,none"]
