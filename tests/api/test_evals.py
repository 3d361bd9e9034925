"""/v1/evals through the official openai client: an eval with string_check, text_similarity, json_schema and a
served judge; a run over a tiny chat model as a batch on the in-process worker; output items whose grades equal
the graders on the batch's own answers; refusals naming the field; and a run resumed after its worker died between
storing a part and grading it, with no item graded twice."""

from __future__ import annotations

import json
import time

import openai
import pytest
from rapidfuzz import fuzz

from tests.api.test_batches import served  # noqa: F401 - a tiny chat model; batch tasks run in-process

ITEMS = [{"question": "Name a colour", "answer": "red"}, {"question": "Say hi", "answer": "hi"},
         {"question": "Count to three", "answer": "one two three"}]
SCHEMA = {"type": "object", "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
          "required": ["question", "answer"]}
CRITERIA = [
    {"type": "string_check", "name": "not empty", "input": "{{sample.output_text}}", "reference": "",
     "operation": "ne"},
    {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
     "operation": "eq"},
    {"type": "text_similarity", "name": "fuzzy", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
     "evaluation_metric": "fuzzy_match", "pass_threshold": 0.0},
    {"type": "score_model", "name": "judge", "model": "tiny", "range": [0, 1],
     "sampling_params": {"max_completions_tokens": 12},
     "input": [{"role": "user", "content": "Question: {{item.question}}\nAnswer: {{sample.output_text}}"}]},
]


@pytest.fixture()
def api(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=client.headers["Authorization"].split()[1],
                         http_client=client, max_retries=0)


def _eval(api, criteria=None):
    return api.evals.create(name="colours", data_source_config={"type": "custom", "item_schema": SCHEMA},
                            testing_criteria=criteria or CRITERIA)


def _data_source(model: str = "tiny", **source):
    return {"type": "completions", "model": model,
            "source": source or {"type": "file_content", "content": [{"item": item} for item in ITEMS]},
            "input_messages": {"type": "template", "template": [{"role": "user", "content": "{{item.question}}"}]},
            "sampling_params": {"max_completion_tokens": 6, "temperature": 0}}


def _wait(api, eval_id: str, run_id: str, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while True:
        run = api.evals.runs.retrieve(run_id, eval_id=eval_id)
        if run.status in ("completed", "failed", "canceled") or time.monotonic() > deadline:
            return run
        time.sleep(0.1)


def test_a_run_generates_on_the_batch_machinery_and_grades_every_item(api, served):  # noqa: F811
    created = _eval(api)
    assert created.object == "eval" and created.data_source_config.schema_["properties"]["item"] == SCHEMA
    assert [c.name for c in created.testing_criteria] == ["not empty", "exact", "fuzzy", "judge"]
    run = api.evals.runs.create(created.id, name="base", data_source=_data_source())
    assert run.object == "eval.run" and run.model == "tiny" and run.result_counts.total == 3
    done = _wait(api, created.id, run.id)
    assert done.status == "completed", done
    counts = done.result_counts
    assert (counts.total, counts.errored) == (3, 0) and counts.passed + counts.failed == 3
    by_name = {r.testing_criteria: r for r in done.per_testing_criteria_results}
    assert (by_name["not empty"].passed, by_name["fuzzy"].passed) == (3, 3)
    assert by_name["exact"].passed + by_name["exact"].failed == 3
    assert done.per_model_usage[0].model_name == "tiny" and done.per_model_usage[0].invocation_count == 3
    items = list(api.evals.runs.output_items.list(run.id, eval_id=created.id))
    assert [i.datasource_item_id for i in items] == [0, 1, 2]
    for output in items:
        item = ITEMS[output.datasource_item_id]
        assert output.datasource_item == item and output.sample.input[0].content == item["question"]
        text = output.sample.output[0].content
        interactive = api.chat.completions.create(model="tiny", max_tokens=6, temperature=0,
                                                  messages=[{"role": "user", "content": item["question"]}])
        assert text == interactive.choices[0].message.content
        results = {r.name: r for r in output.results}
        assert results["exact"].passed is (text == item["answer"])
        assert results["fuzzy"].score == pytest.approx(fuzz.ratio(text, item["answer"]) / 100)
        judge = results["judge"]
        assert judge.sample["output"][0]["content"]  # the judge's own (constrained) answer is kept
        assert output.status == ("pass" if all(r.passed for r in output.results) else "fail")
    one = api.evals.runs.output_items.retrieve(items[1].id, eval_id=created.id, run_id=run.id)
    assert one.id == items[1].id
    assert [r.id for r in api.evals.runs.list(created.id)] == [run.id]
    assert api.evals.retrieve(created.id).name == "colours"
    assert [e.id for e in api.evals.list()] == [created.id]


def test_items_from_an_evals_file_and_refusals_naming_the_field(api, served):  # noqa: F811
    created = _eval(api, CRITERIA[:3])
    upload = api.files.create(file=("items.jsonl", b"".join(json.dumps({"item": i}).encode() + b"\n"
                                                              for i in ITEMS)), purpose="evals")
    run = api.evals.runs.create(created.id, data_source=_data_source(type="file_id", id=upload.id))
    assert _wait(api, created.id, run.id).status == "completed"
    for data_source, field in [
        (_data_source(model="no-such-model"), "data_source.model"),
        (_data_source(type="file_content", content=[{"item": {"question": 1, "answer": "x"}}]),
         "data_source.source.content.0.item"),
        ({**_data_source(), "input_messages": {"type": "template",
                                               "template": [{"role": "user", "content": "{{item.nope}}"}]}},
         "data_source.input_messages"),
    ]:
        with pytest.raises(openai.APIStatusError) as bad:
            api.evals.runs.create(created.id, data_source=data_source)
        assert bad.value.status_code in (404, 422) and bad.value.body["param"] == field, bad.value.body
    with pytest.raises(openai.UnprocessableEntityError) as bad:
        _eval(api, [{**CRITERIA[2], "pass_threshold": None}])
    assert "pass_threshold" in bad.value.body["message"]
    with pytest.raises(openai.UnprocessableEntityError):
        api.files.create(file=("bad.jsonl", b'{"question": "no item key"}\n'), purpose="evals")


def test_a_resumed_run_grades_each_item_once(api, served, settings, worker_ctx, queue, monkeypatch):  # noqa: F811
    import worker.batches.run as batches
    from core.tasks import TASK_BATCH

    settings.batch_chunk_lines = 1
    real = batches.grade_results
    graded: list[str] = []
    died: list[bool] = []

    def grading(ctx, batch_id, results, pacer):
        ids = [r.line["custom_id"] for r in results]
        if ids == ["item-1"] and not died:
            died.append(True)
            raise SystemExit("the worker died after storing item 1's answer, before grading it")
        graded.extend(ids)
        return real(ctx, batch_id, results, pacer)

    monkeypatch.setattr(batches, "grade_results", grading)
    runs: list[str] = []
    queue.handlers[TASK_BATCH] = lambda batch_id: runs.append(batch_id)  # run by hand below
    created = _eval(api, CRITERIA[:3])
    run = api.evals.runs.create(created.id, data_source=_data_source())
    with pytest.raises(SystemExit):
        batches.run_batch(worker_ctx, runs[0])
    first = list(api.evals.runs.output_items.list(run.id, eval_id=created.id))
    assert [i.datasource_item_id for i in first] == [0] and api.evals.runs.retrieve(
        run.id, eval_id=created.id).status == "in_progress"
    batches.run_batch(worker_ctx, runs[0])  # the redelivery: resumes after the stored parts
    done = _wait(api, created.id, run.id)
    assert done.status == "completed" and done.result_counts.total == 3
    items = list(api.evals.runs.output_items.list(run.id, eval_id=created.id))
    assert [i.datasource_item_id for i in items] == [0, 1, 2] and items[0].id == first[0].id
    # item-0 graded once before the death; item-1 (stored, not graded) graded on resume; item-0 never again
    assert sorted(set(graded)) == ["item-0", "item-1", "item-2"]
    assert graded.count("item-2") == 1


def test_a_fine_tuning_job_names_an_eval_run_on_its_base_now_and_on_it_later(api, served, settings):  # noqa: F811
    from core.db import make_engine, make_sessionmaker, session_scope
    from core.rows import Job, JobStatus
    from tests.tiny_chat import chat_jsonl

    created = _eval(api, CRITERIA[:3])
    training = api.files.create(file=("chat.jsonl", chat_jsonl("red")), purpose="fine-tune")
    source = {k: v for k, v in _data_source().items() if k not in ("model", "type")}
    job = api.fine_tuning.jobs.create(model="tiny", training_file=training.id,
                                      extra_body={"eval": {"eval_id": created.id, "data_source": source}})
    runs = {r.role: r for r in api.evals.runs.list(created.id)}
    assert (runs["base"].model, runs["base"].job_id) == ("tiny", job.id)
    assert (runs["fine_tuned"].model, runs["fine_tuned"].status) == (job.id, "queued")
    assert _wait(api, created.id, runs["base"].id).status == "completed"
    engine = make_engine(settings.resolved_database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        session.get(Job, job.id).status = JobStatus.FAILED
    engine.dispose()
    assert api.evals.runs.retrieve(runs["fine_tuned"].id, eval_id=created.id).status == "canceled"
    for extra, field in [({"eval_id": "eval_" + "0" * 24, "data_source": source}, "eval.eval_id"),
                         ({"eval_id": created.id, "data_source": {**source, "input_messages": None}},
                          "eval.data_source"),
                         ({"eval_id": created.id, "data_source": source, "model": "x"}, "eval.model")]:
        with pytest.raises(openai.APIStatusError) as bad:
            api.fine_tuning.jobs.create(model="tiny", training_file=training.id, extra_body={"eval": extra})
        assert bad.value.status_code in (404, 422) and bad.value.body["param"] == field, bad.value.body
    assert len(api.fine_tuning.jobs.list().data) == 1  # a refused eval creates no job


def test_cancel_a_run_with_the_official_client(api, served, queue):  # noqa: F811
    from core.tasks import TASK_BATCH

    queue.handlers[TASK_BATCH] = lambda batch_id: None  # no worker takes it: the run stays in progress
    created = _eval(api, CRITERIA[:1])
    run = api.evals.runs.create(created.id, data_source=_data_source())
    assert api.evals.runs.retrieve(run.id, eval_id=created.id).status == "in_progress"
    assert api.evals.runs.cancel(run.id, eval_id=created.id).status == "canceled"
    assert api.evals.runs.cancel(run.id, eval_id=created.id).status == "canceled"  # again: no error
    assert api.batches.retrieve(run.batch_id).status == "cancelling"  # its runner stops after the chunk it is on
    assert list(api.evals.runs.list(created.id, status="canceled"))[0].id == run.id
    assert api.evals.delete(created.id).deleted is True  # a canceled run does not hold its eval
    with pytest.raises(openai.NotFoundError):
        api.evals.runs.retrieve(run.id, eval_id=created.id)


def test_two_runners_grading_a_runs_last_items_at_once_report_it_once(api, served, settings, worker_ctx, queue,  # noqa: F811
                                                                       monkeypatch):
    """A batch's lease taken over after a stalled heartbeat: two runners grade the base run's last two items at the
    same moment. The run's row lock orders their writes, so one of them sees the run finish and reports it."""
    import threading

    import worker.batches.grading as evals
    import worker.batches.run as batches
    from core.tasks import TASK_BATCH
    from tests.tiny_chat import chat_jsonl

    settings.batch_chunk_lines = 1
    held: list[tuple] = []
    real = batches.grade_results

    def grading(ctx, batch_id, results, pacer):
        if results and results[0].line["custom_id"] in ("item-1", "item-2"):
            held.append((ctx, batch_id, results, pacer))  # graded below, by two runners at once
            return None
        return real(ctx, batch_id, results, pacer)

    monkeypatch.setattr(batches, "grade_results", grading)
    batch_ids: list[str] = []
    queue.handlers[TASK_BATCH] = lambda batch_id: batch_ids.append(batch_id)
    created = _eval(api, CRITERIA[:3])
    training = api.files.create(file=("chat.jsonl", chat_jsonl("red")), purpose="fine-tune")
    source = {k: v for k, v in _data_source().items() if k not in ("model", "type")}
    job = api.fine_tuning.jobs.create(model="tiny", training_file=training.id,
                                      extra_body={"eval": {"eval_id": created.id, "data_source": source}})
    base = {r.role: r for r in api.evals.runs.list(created.id)}["base"]
    batches.run_batch(worker_ctx, batch_ids[0])
    assert len(held) == 2 and api.evals.runs.retrieve(base.id, eval_id=created.id).status == "in_progress"

    both_written = threading.Barrier(2)
    count = evals.graded_count

    def written_then_wait(session, *, run_id):  # each runner between writing its grades and counting the run's
        try:
            both_written.wait(timeout=3)  # with the row lock the second runner waits for the first's commit instead
        except threading.BrokenBarrierError:
            pass
        return count(session, run_id=run_id)

    monkeypatch.setattr(evals, "graded_count", written_then_wait)
    runners = [threading.Thread(target=real, args=args) for args in held]
    for runner in runners:
        runner.start()
    for runner in runners:
        runner.join(60)
    done = api.evals.runs.retrieve(base.id, eval_id=created.id)
    assert done.status == "completed" and done.result_counts.total == 3
    reports = [e.message for e in api.fine_tuning.jobs.list_events(job.id, limit=100) if "eval 'colours'" in e.message]
    assert reports == [f"eval 'colours' on the base model tiny: {done.result_counts.passed}/3 passed "
                       f"({done.result_counts.passed / 3:.0%})"], reports
