"""metric_for_best validation, POST /sweeps (trials, parallelism, idempotency, tenants, cancel) and advancing."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from core import states
from core.db import make_engine, make_sessionmaker
from core.rows import Job, JobStatus, MetricPoint
from core.store import jobs as store
from core.sweeps import advance, prune_reason
from tests.conftest import make_key
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload


@pytest.fixture()
def data_id(client):
    return upload(client, tsv_bytes(sentiment_rows())).json()["id"]


@pytest.fixture()
def sessions(settings):
    engine = make_engine(settings.resolved_database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def _error(response, status, field):
    assert response.status_code == status, response.text
    assert response.json()["error"]["field"] == field, response.text
    return response.json()["error"]


@pytest.mark.parametrize(("body", "field"), [
    ({"hyperparameters": {"metric_for_best": "eval_bleu"}}, "hyperparameters.metric_for_best"),
    ({"hyperparameters": {"early_stopping_patience": 2}}, "hyperparameters.eval_steps"),
    ({"hyperparameters": {"early_stopping_patience": 0, "eval_steps": 2}}, "hyperparameters.early_stopping_patience"),
    ({"hyperparameters": {"early_stopping_patience": 2, "eval_steps": 2}, "eval_dataset": None}, "eval_dataset"),
])
def test_best_metric_and_early_stopping_are_validated(client, data_id, body, field):
    spec = job_body(data_id, data_id) | body
    error = _error(client.post("/jobs", json=spec), 422, field)
    if field.endswith("metric_for_best"):
        assert "eval_loss, eval_accuracy, eval_f1" in error["message"]


def test_causal_lm_jobs_pick_their_best_by_their_own_metrics(client, data_id):
    spec = {"task": "causal-lm", "train_dataset": data_id, "text_column": "sentence",
            "model_config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64},
            "hyperparameters": {"metric_for_best": "eval_accuracy"}}
    assert "eval_loss, perplexity" in _error(client.post("/jobs", json=spec), 422,
                                             "hyperparameters.metric_for_best")["message"]
    spec["hyperparameters"] = {"metric_for_best": "perplexity", "early_stopping_patience": 3, "eval_steps": 5}
    job = client.post("/jobs", json=spec).json()
    assert job["hyperparameters"]["metric_for_best"] == "perplexity" and job["best"] is None


def _sweep(data_id, **overrides):
    base = job_body(data_id, data_id, hyperparameters={"max_steps": 8, "batch_size": 4, "eval_steps": 2})
    return {"job": base, "method": "random", "count": 4, "seed": 7, "parallelism": 2,
            "parameters": {"learning_rate": {"low": 1e-5, "high": 1e-2, "log": True},
                           "batch_size": {"values": [4, 8]}}} | overrides


def test_random_sweep_fixes_its_trials_and_queues_parallelism_children(client, queue, settings, data_id):
    response = client.post("/sweeps", json=_sweep(data_id), headers={"Idempotency-Key": "sweep-1"})
    assert response.status_code == 201, response.text
    sweep = response.json()
    assert (sweep["object"], sweep["status"], sweep["metric"], sweep["greater_is_better"]) == (
        "sweep", "running", "eval_loss", False)
    trials = sweep["trials"]
    assert [t["status"] for t in trials] == ["queued", "queued", "pending", "pending"]
    assert all(1e-5 <= t["params"]["learning_rate"] <= 1e-2 and t["params"]["batch_size"] in (4, 8) for t in trials)
    assert len(queue.sent) == 2 and sweep["job"]["base_model"] == "minilm-l6"
    child = client.get(f"/jobs/{trials[0]['job_id']}").json()
    assert child["sweep_id"] == sweep["id"]
    assert child["hyperparameters"]["learning_rate"] == trials[0]["params"]["learning_rate"]
    # The same key and body: the same sweep, nothing new queued. Another body: 409. Same seed: same trials.
    assert client.post("/sweeps", json=_sweep(data_id), headers={"Idempotency-Key": "sweep-1"}).json()["id"] == \
        sweep["id"]
    assert len(queue.sent) == 2
    _error(client.post("/sweeps", json=_sweep(data_id, seed=8), headers={"Idempotency-Key": "sweep-1"}), 409,
           "Idempotency-Key")
    again = client.post("/sweeps", json=_sweep(data_id)).json()
    assert [t["params"] for t in again["trials"]] == [t["params"] for t in trials]
    assert [s["id"] for s in client.get("/sweeps").json()["data"]] == [again["id"], sweep["id"]]
    # Another tenant sees none of it.
    other = {"Authorization": f"Bearer {make_key(settings.resolved_database_url, tenant='b')}"}
    assert client.get(f"/sweeps/{sweep['id']}", headers=other).status_code == 404
    assert client.get("/sweeps", headers=other).json()["data"] == []

    cancelled = client.post(f"/sweeps/{sweep['id']}/cancel").json()
    assert cancelled["status"] == "cancelled"
    assert [t["status"] for t in cancelled["trials"]] == ["cancelled", "cancelled", "pending", "pending"]
    _error(client.post(f"/sweeps/{sweep['id']}/cancel"), 409, "status")


@pytest.mark.parametrize(("overrides", "field"), [
    ({"method": "grid", "count": None}, "parameters.learning_rate"),  # a grid takes values, not ranges
    ({"method": "grid"}, "count"),
    ({"count": None}, "count"),
    ({"parameters": {"learning_rate": {"values": [1e-3, 5.0]}}}, "parameters.learning_rate"),
    ({"parameters": {"learning_rte": {"values": [1e-3]}}}, "parameters.learning_rte"),
    ({"parameters": {"metric_for_best": {"values": ["eval_f1"]}}}, "parameters.metric_for_best"),
    ({"parameters": {"learning_rate": {"low": 0, "high": 1, "log": True}}}, "parameters.learning_rate"),
    ({"parallelism": 0}, "parallelism"),
])
def test_bad_sweeps_are_refused_naming_the_field(client, data_id, overrides, field):
    _error(client.post("/sweeps", json=_sweep(data_id, **overrides)), 422, field)


def test_a_sweep_without_evaluations_cannot_prune(client, data_id):
    spec = _sweep(data_id)
    spec["job"]["hyperparameters"].pop("eval_steps")
    _error(client.post("/sweeps", json=spec), 422, "job.hyperparameters.eval_steps")
    spec["job"].pop("eval_dataset")
    _error(client.post("/sweeps", json=spec | {"pruning": None}), 422, "job.eval_dataset")


def _finish(sessions, job_id, value, status=JobStatus.SUCCEEDED):
    with sessions() as session:
        job = store.get_job(session, job_id=job_id)
        session.execute(update(Job).where(Job.id == job_id).values(status=JobStatus.RUNNING))
        session.refresh(job)
        job.best = {"step": 8, "metric": "eval_loss", "value": value}
        states.move(session, job, status, message="test", code="x" if status == JobStatus.FAILED else None)
        session.commit()


def test_advance_fills_freed_slots_once_and_names_the_best_child(client, data_id, sessions):
    sweep = client.post("/sweeps", json=_sweep(data_id, method="grid", count=None, parameters={
        "learning_rate": {"values": [1e-3, 1e-2, 3e-2]}})).json()
    first, second = (t["job_id"] for t in sweep["trials"][:2])
    _finish(sessions, first, 0.4)
    for _ in range(2):  # the worker's hook and the periodic round both run: one new child, not two
        with sessions() as session:
            advance(session, sweep_id=sweep["id"])
            session.commit()
    trials = client.get(f"/sweeps/{sweep['id']}").json()["trials"]
    assert [t["status"] for t in trials] == ["succeeded", "queued", "queued"]
    _finish(sessions, second, 0.3)
    _finish(sessions, trials[2]["job_id"], 0.2, status=JobStatus.FAILED)  # failed: not a candidate
    with sessions() as session:
        assert advance(session, sweep_id=sweep["id"]) == []
        session.commit()
    done = client.get(f"/sweeps/{sweep['id']}").json()
    assert done["status"] == "succeeded" and done["finished_at"] is not None
    assert (done["best"]["job_id"], done["best"]["trial"], done["best"]["value"]) == (second, 1, 0.3)


def test_median_rule_prunes_a_child_behind_the_others_at_the_same_step(client, data_id, sessions):
    spec = _sweep(data_id, method="grid", count=None, parallelism=3,
                  pruning={"min_evaluations": 2, "min_trials": 2},
                  parameters={"learning_rate": {"values": [1e-3, 1e-2, 3e-2]}})
    a, b, c = (t["job_id"] for t in client.post("/sweeps", json=spec).json()["trials"])
    sweep_id = client.get(f"/jobs/{a}").json()["sweep_id"]
    losses = {a: [0.6, 0.5], b: [0.6, 0.4], c: [0.65, 0.55]}
    with sessions() as session:
        session.add_all(MetricPoint(job_id=job, step=2 * (i + 1), name="eval_loss", value=v, epoch=0.0)
                        for job, values in losses.items() for i, v in enumerate(values))
        session.commit()
        assert prune_reason(session, job_id=c, sweep_id=sweep_id, step=2) is None  # one evaluation only
        reason = prune_reason(session, job_id=c, sweep_id=sweep_id, step=4)
        assert reason is not None and "median 0.4500 of 2 other trial(s)" in reason
        assert prune_reason(session, job_id=b, sweep_id=sweep_id, step=4) is None  # 0.4 is ahead of 0.525
