"""A job kind added through the registry alone: one declaration (tests.toy_kind) naming its spec, admission checks
and engine entry (tests.toy_engine); nothing else knows it, yet it is validated, admitted, stored, claimed, trained
by the one loop, checkpointed, evaluated and saved. Every registered kind is complete on both sides: its admission
checks resolve on the API, its engine entries (data-format variants too) on a worker, and nothing is registered on
one side only. (The same kind on a worker process, loaded by TRAINSERVE_JOB_KIND_MODULES:
tests/integration/test_job_kind_plugin.py.)
"""

from __future__ import annotations

from typing import Literal

import pytest

from core.auth import Principal
from core.db import session_scope
from core.jobspec import KINDS, JobKind, parse_spec, register, unregister
from tests.factories import sentiment_rows, tsv_bytes, upload

TOY = "text-length"  # tests.toy_kind's kind; imported only by the fixture, so no other test sees it registered
TENANT = Principal(key_id="key", tenant_id="tenant-a", is_admin=False)  # the tenant of the client's key


@pytest.fixture(scope="module")
def toy_kind():
    from tests import toy_kind  # importing registers the kind (its one declaration); the fixture takes it out again

    register(toy_kind.KIND)  # again: an earlier test may have removed it after importing the module
    yield toy_kind
    unregister(TOY)


def test_a_kind_added_through_the_registry_runs_end_to_end_on_a_worker(toy_kind, client, queue, settings):
    from app.services.jobs import create_job
    from worker.context import WorkerContext
    from worker.jobs.lifecycle import run_training_job

    dataset = upload(client, tsv_bytes(sentiment_rows(2))).json()["id"]
    body = {"task": TOY, "train_dataset": dataset, "text_column": "sentence",
            "hyperparameters": {"max_steps": 30, "eval_steps": 10}}
    spec = parse_spec(body)
    assert isinstance(spec, toy_kind.ToyJob) and spec.hyperparameters.learning_rate == 0.05  # defaults from the model
    ctx = WorkerContext(settings, queue)
    try:
        with session_scope(ctx.sessions) as session:
            job_id = create_job(session, settings, queue, TENANT, spec=spec).id
        assert run_training_job(ctx, job_id) == "succeeded"
    finally:
        ctx.close()
    job = client.get(f"/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["task"] == TOY, job["error"]
    assert job["hyperparameters"]["learning_rate"] == 0.05 and job["hyperparameters"]["max_steps"] == 30
    assert job["progress"]["step"] == 30 and job["best"]["metric"] == "eval_mae"
    maes = [p["value"] for p in client.get(f"/jobs/{job_id}/metrics").json()["data"] if p["name"] == "eval_mae"]
    assert len(maes) == 3 and maes[-1] < maes[0]  # evaluated at steps 10, 20, 30, and it learned
    events = [e["kind"] for e in client.get(f"/jobs/{job_id}/events").json()["data"]]
    assert events[:2] == ["created", "claimed"] and events[-1] == "succeeded"
    model = next(a for a in job["artifacts"] if a["kind"] == "model")
    assert {"manifest.json", "model.safetensors"} <= set(model["files"])
    assert queue.sent  # its task message went through the outbox like any job's


def test_a_registered_kind_checks_metric_for_best_against_its_own_metrics(toy_kind, client, settings, queue):
    from app.services.jobs import create_job
    from core.errors import ValidationFailed

    dataset = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    spec = parse_spec({"task": TOY, "train_dataset": dataset, "text_column": "sentence",
                       "hyperparameters": {"metric_for_best": "eval_accuracy"}})
    from core.db import make_engine, make_sessionmaker

    engine = make_engine(settings.resolved_database_url)
    try:
        with session_scope(make_sessionmaker(engine)) as session:
            with pytest.raises(ValidationFailed) as refused:
                create_job(session, settings, queue, TENANT, spec=spec)
    finally:
        engine.dispose()
    assert refused.value.field == "hyperparameters.metric_for_best" and "eval_mae" in refused.value.message


def test_a_registered_kind_is_offered_by_the_fine_tuning_route_and_its_schema(toy_kind, client):
    schema = client.get("/openapi.json").json()["components"]["schemas"]["FineTuningJobCreate"]
    assert TOY in schema["properties"]["task"]["enum"]  # the kinds registered when the document is built
    dataset = upload(client, tsv_bytes(sentiment_rows(2))).json()["id"]
    body = {"model": "minilm-l6", "training_file": dataset, "task": TOY, "text_column": "sentence",
            "hyperparameters": {"n_epochs": 2, "max_steps": 5}}
    refused = client.post("/v1/fine_tuning/jobs", json={**body, "hyperparameters": None, "method": {"type": "dpo"}})
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "method.type"  # it has no dpo
    response = client.post("/v1/fine_tuning/jobs", json=body)
    assert response.status_code == 200, response.text
    job = client.get(f"/jobs/{response.json()['id']}").json()
    assert job["task"] == TOY and job["method"] is None and job["hyperparameters"]["epochs"] == 2
    assert job["hyperparameters"]["learning_rate"] == toy_kind.ToyHyperparameters().learning_rate
    unknown = client.post("/v1/fine_tuning/jobs", json={**body, "task": "text-lengths"})
    assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "task"


def test_every_registered_kind_is_complete_on_both_sides(toy_kind):
    """The startup checks of the API and of a training worker pass for the built-in kinds and a plugin's."""
    from app.services import job_kinds
    from worker.engines.training import kinds

    job_kinds.check_kinds()
    kinds.check_kinds()
    for kind in KINDS.values():
        assert callable(job_kinds.admission_checks(kind)), kind.name
        for name in kind.engines:
            engine = kinds.engine_kind(name)
            assert set(engine.hyperparameters) == set(kind.hyperparameters.model_fields), name
    assert set(KINDS["causal-lm"].engines) == {"causal-lm", "causal-lm/chat", "causal-lm/prompts"}
    assert KINDS["causal-lm"].chat_data and not KINDS["text-classification"].chat_data


def test_nothing_is_registered_on_one_side_only():
    """Each EngineKind the built-in engine module defines is some kind's entry, and each admission function the API
    module offers for a kind is some kind's checks: an entry no kind names would never run."""
    from app.services import job_kinds
    from worker.engines.training import kinds

    named = {ref for kind in KINDS.values() for ref in (kind.admission, *kind.engines.values())}
    engines = {f"{kinds.__name__}:{name}" for name, value in vars(kinds).items() if isinstance(value, kinds.EngineKind)}
    assert engines and engines <= named
    checks = {f"{job_kinds.__name__}:{name}" for name in vars(job_kinds) if name.endswith("_fields")
              and name != "kind_fields"}
    assert checks and checks <= named


def test_a_kind_missing_a_part_stops_the_side_that_needs_it(toy_kind):
    from app.services import job_kinds
    from worker.engines.training import kinds

    class Broken(toy_kind.ToyJob):
        task: Literal["broken"]  # type: ignore[assignment]

    register(JobKind(Broken, {"eval_loss": False}, admission="tests.toy_kind:no_such_checks",
                     engine="tests.toy_engine:ENGINE", variants={"chat": "tests.toy_kind:KIND"}))
    try:
        with pytest.raises(job_kinds.IncompleteKind, match="broken: tests.toy_kind:no_such_checks names no"):
            job_kinds.check_kinds()
        with pytest.raises(kinds.IncompleteKind) as refused:
            kinds.check_kinds()
        assert "broken/chat: tests.toy_kind:KIND is a JobKind, not an EngineKind" in str(refused.value)
        assert "text-length, broken share the config ToyConfig" in str(refused.value)  # a launch could not tell
    finally:
        unregister("broken")
    with pytest.raises(ValueError, match="variants are keyed by"):
        JobKind(Broken, {}, admission="a:b", engine="a:b", variants={"csv": "a:b"})
    with pytest.raises(ValueError, match="not a `module:attribute` reference"):
        JobKind(Broken, {}, admission="app.services.job_kinds", engine="a:b")
