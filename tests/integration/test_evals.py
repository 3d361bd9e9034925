"""Evals on real processes (`trainserve up`: the API, a training and a generation worker) with the official
client: a LoRA fine-tuning job names an eval (string_check, text_similarity, a served score_model judge), which runs
on the tiny Llama base when the job is created and on the fine-tune once it succeeds; the fine-tune passes more,
and the job's events say so beside the base's result. The fine-tune's run survives a SIGKILLed generation worker:
the restarted worker resumes the run's batch and never grades a finished item again."""

from __future__ import annotations

import os
import shutil
import signal
import time

import openai
import pytest

from tests.integration.conftest import wait_for
from tests.integration.test_local_mode import _processes, _up
from tests.integration.test_lora_jobs import LM_HP, LORA
from tests.tiny_chat import QUESTIONS, chat_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

ANSWER = "Blue."
CRITERIA = [
    {"type": "string_check", "name": "says blue", "input": "{{sample.output_text}}", "reference": "blue",
     "operation": "ilike"},
    {"type": "text_similarity", "name": "close to the answer", "input": "{{sample.output_text}}",
     "reference": "{{item.answer}}", "evaluation_metric": "fuzzy_match", "pass_threshold": 0.8},
    {"type": "score_model", "name": "judge", "model": "tiny", "range": [0, 1], "pass_threshold": 0,
     "sampling_params": {"max_completions_tokens": 16},
     "input": [{"role": "user", "content": "Expected: {{item.answer}}\nGot: {{sample.output_text}}\nScore 0-1."}]},
]


def _rates(run) -> dict[str, int]:
    return {r.testing_criteria: r.passed for r in run.per_testing_criteria_results}


def _finished(api, eval_id: str, run_id: str, timeout: float = 150):
    return wait_for(lambda: (run := api.evals.runs.retrieve(run_id, eval_id=eval_id)).status
                    in ("completed", "failed", "canceled") and run, timeout, f"eval run {run_id} to end")


def test_a_fine_tune_beats_its_base_on_an_eval_and_a_killed_worker_grades_nothing_twice(tmp_path, tiny_llama_dir):
    home = tmp_path / "home"
    shutil.copytree(tiny_llama_dir, home / "models" / "tiny")
    # One line at a time (one row of the engine, one line a chunk): the run lasts long enough to be killed mid-way.
    proc, http = _up(home, tmp_path / "up.log", TRAINSERVE_BATCH_STALE_S="3", TRAINSERVE_BATCH_CHUNK_LINES="1",
                     TRAINSERVE_BATCH_SHARE="0.01", TRAINSERVE_BATCH_IDLE_SHARE="0.01",
                     TRAINSERVE_GENERATION_PRECISION="fp32")
    try:
        api = openai.OpenAI(base_url=f"{str(http.base_url).rstrip('/')}/v1",
                            api_key=http.headers["Authorization"].split()[1], max_retries=0, timeout=60)
        schema = {"type": "object", "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
                  "required": ["question", "answer"]}
        evaluation = api.evals.create(name="sky", data_source_config={"type": "custom", "item_schema": schema},
                                      testing_criteria=CRITERIA)
        items = [{"item": {"question": q, "answer": ANSWER}} for q in QUESTIONS] * 4
        template = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "{{item.question}}"}]
        data_source = {"source": {"type": "file_content", "content": items},
                       "input_messages": {"type": "template", "template": template},
                       "sampling_params": {"max_completion_tokens": 6, "temperature": 0}}
        training = api.files.create(file=("chat.jsonl", chat_jsonl(ANSWER)), purpose="fine-tune")
        hyperparameters = {"batch_size": LM_HP["batch_size"], "learning_rate": LM_HP["learning_rate"],
                           "max_steps": LM_HP["max_steps"], "precision": "fp32", "block_size": 128}
        job = api.fine_tuning.jobs.create(
            model="tiny", training_file=training.id,
            method={"type": "supervised", "supervised": {"hyperparameters": hyperparameters}},
            extra_body={"adapter": LORA, "eval": {"eval_id": evaluation.id, "data_source": data_source}})
        # The job's eval: a run on the base now, one on the fine-tune once the job succeeds.
        runs = {r.role: r for r in api.evals.runs.list(evaluation.id)}
        assert runs["base"].model == "tiny" and runs["fine_tuned"].model == job.id
        assert runs["fine_tuned"].status == "queued"
        base = _finished(api, evaluation.id, runs["base"].id)
        assert base.status == "completed" and base.result_counts.total == len(items)
        wait_for(lambda: api.fine_tuning.jobs.retrieve(job.id).status in ("succeeded", "failed"), 200, "the job")
        assert api.fine_tuning.jobs.retrieve(job.id).status == "succeeded"

        run = runs["fine_tuned"]
        [victim] = [pid for pid, parent, args in _processes() if parent == proc.pid and "--queues generation" in args]

        def started_then_killed() -> bool:  # killed once the run has left the queue: its lines stored part by part
            if api.evals.runs.retrieve(run.id, eval_id=evaluation.id).status == "queued":
                return False
            os.kill(victim, signal.SIGKILL)
            return True

        wait_for(started_then_killed, 120, "the fine-tune's run to start")
        killed_at = time.time()
        before = api.evals.runs.output_items.list(run.id, eval_id=evaluation.id, limit=100).data
        # Killed mid-run on a loaded machine; on a quiet one the tiny model may finish first (then nothing resumes).
        mid_run = api.evals.runs.retrieve(run.id, eval_id=evaluation.id).status == "in_progress"
        assert len(before) <= len(items)

        tuned = _finished(api, evaluation.id, run.id)
        assert tuned.status == "completed" and tuned.result_counts.total == len(items)
        after = api.evals.runs.output_items.list(run.id, eval_id=evaluation.id, limit=100).data
        assert [i.datasource_item_id for i in after] == list(range(len(items)))  # every item, each once
        kept = {i.id: i.created_at for i in after}
        assert all(kept.get(i.id) == i.created_at and i.created_at <= killed_at for i in before)  # never regraded
        # A worker killed before it stored a part has nothing to resume: the next one starts at line 0.
        assert not (mid_run and before) or "resuming at line" in (tmp_path / "up.log").read_text()

        base_rates, tuned_rates = _rates(base), _rates(tuned)
        assert tuned_rates["says blue"] > base_rates["says blue"], (base_rates, tuned_rates)
        assert tuned_rates["close to the answer"] > base_rates["close to the answer"], (base_rates, tuned_rates)
        assert tuned.result_counts.passed > base.result_counts.passed  # every criterion, the judge's too
        assert tuned_rates["judge"] == len(items)  # the judge's answer is held to {"result": a number in range}
        judged = after[0].results[2]
        assert judged.name == "judge" and judged.sample["output"][0]["content"]  # the judge answered
        assert {u.model_name for u in tuned.per_model_usage} == {job.id}
        # An event per run; the run that finished second (the base's, when its first runner was slow to load the
        # model) puts the other's result beside its own.
        events = [e for e in api.fine_tuning.jobs.list_events(job.id, limit=100) if "eval 'sky'" in e.message]
        assert sorted(e.data["role"] for e in events) == ["base", "fine_tuned"], [e.message for e in events]
        [compared] = [e for e in events if {"base", "fine_tuned"} <= set(e.data)]
        assert f"{tuned.result_counts.passed}/{len(items)}" in compared.message
        assert f"{base.result_counts.passed}/{len(items)}" in compared.message
        assert compared.data["fine_tuned"]["pass_rate"] > compared.data["base"]["pass_rate"]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        http.close()
