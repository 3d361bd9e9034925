"""/v1/evals at size and across tenants: judge graders' served-model calls per item bounded
(TRAINSERVE_MAX_GRADER_MODEL_CALLS), each item's size checked as a chat's messages are, an evals file and a run's kept
items read a line at a time, run counts kept on the run's row as items are graded (concurrent graders add up), and
another tenant's ids refused as paging cursors."""

from __future__ import annotations

import json
import threading

from core.storage import ArtifactStore
from tests.conftest import make_key
from tests.tiny_lm import build_tiny_gpt2

SCHEMA = {"type": "object", "properties": {"question": {"type": "string"}}, "required": ["question"]}
CHECK = {"type": "string_check", "name": "said", "input": "{{sample.output_text}}", "reference": "",
         "operation": "ne"}


def _judge(name: str) -> dict:
    return {"type": "score_model", "name": name, "model": "tiny", "range": [0, 1],
            "sampling_params": {"max_completions_tokens": 4},
            "input": [{"role": "user", "content": "{{sample.output_text}}"}]}


def _multi(name: str, judges: int) -> dict:
    return {"type": "multi", "name": name, "calculate_output": "+".join(f"g{i}" for i in range(judges)),
            "graders": {f"g{i}": _judge(f"g{i}") for i in range(judges)}}


def _eval(client, criteria: list[dict]):
    return client.post("/v1/evals", json={"data_source_config": {"type": "custom", "item_schema": SCHEMA},
                                          "testing_criteria": criteria})


def _run_body(source: dict, template: str = "{{item.question}}") -> dict:
    return {"data_source": {"type": "completions", "model": "tiny", "source": source,
                            "input_messages": {"type": "template",
                                               "template": [{"role": "user", "content": template}]}}}


def _field(response) -> str:
    assert response.status_code == 422, response.text
    return response.json()["error"]["field"]


def test_graders_calling_served_models_more_than_the_bound_per_item_are_a_422_naming_the_grader(client, settings):
    assert settings.max_grader_model_calls == 20
    assert _field(_eval(client, [_multi("many", 21)])) == "testing_criteria.0.graders.g20"
    assert _eval(client, [_multi("twenty", 20)]).status_code == 200
    settings.max_grader_model_calls = 3
    cosine = {"type": "text_similarity", "name": "near", "input": "{{sample.output_text}}", "reference": "x",
              "evaluation_metric": "cosine", "pass_threshold": 0.5}
    # the criteria's calls add up: 2 judges, a cosine similarity's embeddings, then one judge too many
    assert _field(_eval(client, [_multi("two", 2), cosine, CHECK, _judge("one")])) == "testing_criteria.3"
    assert _eval(client, [_multi("two", 2), cosine, CHECK]).status_code == 200
    validate = client.post("/v1/fine_tuning/alpha/graders/validate", json={"grader": _multi("four", 4)})
    assert _field(validate) == "grader.graders.g3"
    run = client.post("/v1/fine_tuning/alpha/graders/run",
                      json={"grader": _multi("four", 4), "model_sample": "hi", "item": {}})
    assert _field(run) == "grader.graders.g3"  # refused before any judge is called


def test_an_item_over_the_models_prompt_bytes_is_a_422_naming_the_item(client, settings, queue):
    build_tiny_gpt2(settings.home / "models" / "tiny", n_positions=64)  # 64 tokens: at most 64 x 32 bytes
    created = _eval(client, [CHECK]).json()["id"]
    big = {"question": "x" * 2100}
    small = {"question": "hi"}
    response = client.post(f"/v1/evals/{created}/runs", json=_run_body(
        {"type": "file_content", "content": [{"item": small}, {"item": big}]}))
    assert _field(response) == "data_source.source.content.1.item" and "2048 bytes" in response.json()["error"][
        "message"]
    # a template that repeats a small item's field past the bound: its messages are the prompt
    response = client.post(f"/v1/evals/{created}/runs", json=_run_body(
        {"type": "file_content", "content": [{"item": {"question": "y" * 300}}]}, "{{item.question}}" * 8))
    assert _field(response) == "data_source.source.content.0.item"
    upload = client.post("/v1/files", data={"purpose": "evals"}, files={"file": (
        "items.jsonl", b"".join(json.dumps({"item": i}).encode() + b"\n" for i in (small, small, big)))}).json()
    response = client.post(f"/v1/evals/{created}/runs", json=_run_body({"type": "file_id", "id": upload["id"]}))
    assert _field(response) == "data_source.source.id" and "item 2 of the file" in response.json()["error"]["message"]
    assert client.get(f"/v1/evals/{created}/runs").json()["data"] == []  # nothing half-written
    ok = client.post(f"/v1/evals/{created}/runs",
                     json=_run_body({"type": "file_content", "content": [{"item": small}]}))
    assert ok.status_code == 200, ok.text


class _CountingStream:
    """A stream that counts the lines read from it."""

    def __init__(self, stream, counter: list[int]) -> None:
        self.stream, self.counter = stream, counter

    def __iter__(self):
        for line in self.stream:
            self.counter[0] += 1
            yield line

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stream.close()


def _count_lines(monkeypatch) -> list[int]:
    counter = [0]
    real = ArtifactStore.open
    monkeypatch.setattr(ArtifactStore, "open", lambda self, key: _CountingStream(real(self, key), counter))
    return counter


def test_an_evals_file_is_read_a_line_at_a_time_and_no_further_than_the_item_bound(client, settings, queue,
                                                                                  monkeypatch):
    import app.services.evals as service

    build_tiny_gpt2(settings.home / "models" / "tiny", n_positions=64)
    created = _eval(client, [CHECK]).json()["id"]
    upload = client.post("/v1/files", data={"purpose": "evals"}, files={"file": (
        "items.jsonl", b"".join(json.dumps({"item": {"question": f"q{i}"}}).encode() + b"\n"
                                for i in range(2000)))}).json()
    monkeypatch.setattr(service, "MAX_ITEMS", 5)
    lines = _count_lines(monkeypatch)
    response = client.post(f"/v1/evals/{created}/runs", json=_run_body({"type": "file_id", "id": upload["id"]}))
    assert _field(response) == "data_source.source" and "at most 5 items" in response.json()["error"]["message"]
    assert lines[0] <= 6  # not the whole file's 2000 lines


def test_a_runs_items_are_read_only_up_to_the_last_index_asked_for(settings, monkeypatch):
    from core.eval_runs import RunItems, items_at, store_items
    from core.evals import SourceItem
    from core.storage import open_storage

    storage = open_storage(settings)
    store_items(storage, "evalrun_x", RunItems(inline=[SourceItem(item={"n": i}) for i in range(1000)]))
    lines = _count_lines(monkeypatch)
    assert items_at(storage, "evalrun_x", [3, 1]) == {1: {"n": 1}, 3: {"n": 3}}
    assert lines[0] == 4
    assert items_at(storage, "evalrun_x", []) == {}


def test_run_counts_are_kept_on_the_runs_row_by_concurrent_graders(client, settings, queue):
    """Many graders of one run storing items at once (leases taken over, a redelivered batch): every item counted
    once, in Postgres, and the API reads the counts from the row."""
    from core.db import make_engine, make_sessionmaker, session_scope
    from core.rows import EvalOutputItem, EvalRun, new_id, utcnow
    from core.store.evals import count_items

    build_tiny_gpt2(settings.home / "models" / "tiny", n_positions=64)
    queue.handlers.clear()  # no worker: the run stays in progress while the threads below grade it
    created = _eval(client, [CHECK]).json()["id"]
    content = [{"item": {"question": f"q{i}"}} for i in range(24)]
    run = client.post(f"/v1/evals/{created}/runs", json=_run_body({"type": "file_content", "content": content}))
    run_id = run.json()["id"]
    engine = make_engine(settings.resolved_database_url)
    sessions = make_sessionmaker(engine)
    start = threading.Barrier(8)
    statuses = ["pass", "fail", "error"]

    def grader(first: int) -> None:
        start.wait(timeout=10)
        for index in range(first, 24, 8):
            status = statuses[index % 3]
            item = EvalOutputItem(id=new_id("outitem"), run_id=run_id, eval_id=created, datasource_item_id=index,
                                  status=status, created_at=utcnow(),
                                  sample={"model": "tiny", "usage": {"prompt_tokens": 2, "completion_tokens": 1,
                                                                     "total_tokens": 3}},
                                  results=[{"name": "said", "type": "string_check", "passed": status == "pass"}])
            with session_scope(sessions) as session:
                locked = session.get(EvalRun, run_id, with_for_update=True)
                session.add(item)
                count_items(session, run=locked, items=[item])

    threads = [threading.Thread(target=grader, args=(first,)) for first in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    with session_scope(sessions) as session:
        row = session.get(EvalRun, run_id)
        assert (row.passed, row.failed, row.errored) == (8, 8, 8)
        assert row.criteria_counts == {"said": {"passed": 8, "failed": 16}}
        assert row.model_usage["tiny"]["invocation_count"] == 24 and row.model_usage["tiny"]["total_tokens"] == 72
    engine.dispose()
    done = client.get(f"/v1/evals/{created}/runs/{run_id}").json()
    assert done["result_counts"] == {"total": 24, "passed": 8, "failed": 8, "errored": 8}
    assert done["per_testing_criteria_results"] == [{"testing_criteria": "said", "passed": 8, "failed": 16}]
    assert done["per_model_usage"][0]["invocation_count"] == 24


def test_another_tenants_ids_are_refused_as_paging_cursors(client, settings, queue):
    from core.db import make_engine, make_sessionmaker, session_scope
    from core.rows import EvalOutputItem, new_id, utcnow

    build_tiny_gpt2(settings.home / "models" / "tiny", n_positions=64)
    queue.handlers.clear()
    body = _run_body({"type": "file_content", "content": [{"item": {"question": "q"}}]})
    mine = _eval(client, [CHECK]).json()["id"]
    my_run = client.post(f"/v1/evals/{mine}/runs", json=body).json()["id"]
    item_id = new_id("outitem")
    engine = make_engine(settings.resolved_database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        session.add(EvalOutputItem(id=item_id, run_id=my_run, eval_id=mine, datasource_item_id=0, status="pass",
                                   sample={}, results=[], created_at=utcnow()))
    engine.dispose()
    other = {"Authorization": f"Bearer {make_key(settings.resolved_database_url, tenant='tenant-b')}"}
    theirs = client.post("/v1/evals", headers=other, json={
        "data_source_config": {"type": "custom", "item_schema": SCHEMA}, "testing_criteria": [CHECK]}).json()["id"]
    their_run = client.post(f"/v1/evals/{theirs}/runs", headers=other, json=body).json()["id"]
    for url in [f"/v1/evals?after={mine}", f"/v1/evals/{theirs}/runs?after={my_run}",
                f"/v1/evals/{theirs}/runs/{their_run}/output_items?after={item_id}",
                f"/v1/evals/{mine}/runs/{my_run}/output_items", f"/v1/evals/{theirs}/runs/{my_run}"]:
        response = client.get(url, headers=other)
        assert response.status_code == 404, (url, response.text)
    assert client.get("/v1/evals", headers=other).json()["data"][0]["id"] == theirs
    assert [i["id"] for i in client.get(f"/v1/evals/{mine}/runs/{my_run}/output_items").json()["data"]] == [item_id]
