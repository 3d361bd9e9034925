"""POST /jobs validation, polling, listing, cancel and history against a real PostgreSQL."""

from __future__ import annotations

import pytest

from core import states
from core.db import make_engine, make_sessionmaker, session_scope
from core.store import jobs as store
from core.tasks import QUEUE_TRAIN, TASK_TRAIN
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload


@pytest.fixture()
def train_id(client):
    return upload(client, tsv_bytes(sentiment_rows())).json()["id"]


def _error(response, status, field):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["field"] == field, error
    return error


def test_create_job_resolves_hyperparameters_and_enqueues_by_name(client, queue, train_id):
    response = client.post("/jobs", json=job_body(train_id, metadata={"team": "nlp"}))
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["status"] == "queued"
    assert job["labels"] == [0, 1]
    assert job["hyperparameters"]["learning_rate"] == 5e-5
    assert job["hyperparameters"]["epochs"] == 1
    assert job["progress"] == {"step": 0, "total_steps": None, "epoch": 0.0, "fraction": 0.0}
    assert job["metadata"] == {"team": "nlp"}
    assert queue.sent == [(TASK_TRAIN, [job["id"]], QUEUE_TRAIN)]
    assert client.get(f"/jobs/{job['id']}").json()["id"] == job["id"]
    events = client.get(f"/jobs/{job['id']}/events").json()["data"]
    assert [e["kind"] for e in events] == ["created"]


def test_string_labels_build_a_label_map(client):
    rows = [(t, "pos" if y else "neg") for t, y in sentiment_rows()]
    ds = upload(client, tsv_bytes(rows)).json()["id"]
    job = client.post("/jobs", json=job_body(ds)).json()
    assert job["labels"] == ["neg", "pos"]


@pytest.mark.parametrize(("override", "field"), [
    ({"base_model": "no-such-model"}, "base_model"),
    ({"base_model": "/nonexistent/folder"}, "base_model"),
    ({"text_column": "sentnce"}, "text_column"),
    ({"label_column": "lable"}, "label_column"),
    ({"train_dataset": "ds_missing"}, "train_dataset"),
    ({"eval_dataset": "ds_missing"}, "eval_dataset"),
    ({"hyperparameters": {"learning_rate": -1}}, "hyperparameters.learning_rate"),
    ({"hyperparameters": {"batch_size": 0}}, "hyperparameters.batch_size"),
    ({"hyperparameters": {"precision": "fp8"}}, "hyperparameters.precision"),
    ({"hyperparameters": {"max_length": 100000}}, "hyperparameters.max_length"),
    ({"hyperparameters": {"learning_rte": 1e-4}}, "hyperparameters.learning_rte"),
    ({"task": "image-classification"}, "task"),
    ({"surprise": 1}, "surprise"),
])
def test_bad_job_requests_name_the_field(client, queue, train_id, override, field):
    body = job_body(train_id)
    body.update(override)
    _error(client.post("/jobs", json=body), 422, field)
    assert client.get("/jobs").json()["data"] == []
    assert queue.sent == []


def test_one_class_and_empty_labels_are_refused(client):
    one_class = upload(client, tsv_bytes([(t, 1) for t, _ in sentiment_rows()])).json()["id"]
    error = _error(client.post("/jobs", json=job_body(one_class)), 422, "train_dataset")
    assert "one class" in error["message"]
    gaps = upload(client, b"sentence\tlabel\ngood\t1\nbad\t\nfine\t0\n").json()["id"]
    assert "empty" in _error(client.post("/jobs", json=job_body(gaps)), 422, "train_dataset")["message"]


def test_eval_labels_must_exist_in_training(client, train_id):
    other = upload(client, tsv_bytes([("meh", 2), ("ok", 0)])).json()["id"]
    _error(client.post("/jobs", json=job_body(train_id, other)), 422, "eval_dataset")


def test_malformed_json_is_422_envelope(client):
    response = client.post("/jobs", content=b"{nope", headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "validation_error"


def test_broker_outage_keeps_the_job_queued_until_the_relay_sends_it(client, queue, settings, train_id):
    # Was: 503 and a failed row. The task message now commits with the row (outbox), so a refusing broker
    # only delays the job: 201, queued, and the relay sends the message once the broker is back.
    from core.relay import deliver
    from core.store import outbox

    queue.refuse = True
    response = client.post("/jobs", json=job_body(train_id))
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["status"] == "queued" and job["error"] is None and queue.sent == []
    engine = make_engine(settings.resolved_database_url)
    factory = make_sessionmaker(engine)
    with factory() as session:
        [waiting] = outbox.unsent(session, job_id=job["id"])
        assert waiting.attempts >= 1 and "unavailable" in (waiting.last_error or "")
    queue.refuse = False
    with factory() as session:
        deliver(session, queue)  # the API's relay thread may have got there first: either way, sent once
    assert queue.sent == [(TASK_TRAIN, [job["id"]], QUEUE_TRAIN)]
    with factory() as session:
        assert outbox.unsent(session, job_id=job["id"]) == []
        assert store.get_job(session, job_id=job["id"]).task_id == "task-1"
    engine.dispose()
    assert client.get(f"/jobs/{job['id']}").json()["status"] == "queued"


def test_cancel_queued_then_cancel_again_is_409(client, queue, train_id):
    job = client.post("/jobs", json=job_body(train_id)).json()
    cancelled = client.post(f"/jobs/{job['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert queue.revoked == ["task-1"]
    _error(client.post(f"/jobs/{job['id']}/cancel"), 409, "status")
    _error(client.post("/jobs/job_nope/cancel"), 404, None)


def test_cancel_running_sets_a_request_the_worker_sees(client, settings, train_id):
    job = client.post("/jobs", json=job_body(train_id)).json()
    engine = make_engine(settings.resolved_database_url)
    factory = make_sessionmaker(engine)
    with session_scope(factory) as session:
        from core.rows import utcnow

        states.claim_job(session, job_id=job["id"], device="cpu", now=utcnow(), stale_before=utcnow())
    body = client.post(f"/jobs/{job['id']}/cancel").json()
    assert body["status"] == "running" and body["cancel_requested"] is True
    with factory() as session:
        assert store.cancel_requested(session, job_id=job["id"])
    engine.dispose()


def test_list_filter_and_paginate(client, train_id):
    ids = [client.post("/jobs", json=job_body(train_id)).json()["id"] for _ in range(3)]
    client.post(f"/jobs/{ids[0]}/cancel")
    page = client.get("/jobs", params={"limit": 2}).json()
    assert [j["id"] for j in page["data"]] == [ids[2], ids[1]]
    rest = client.get("/jobs", params={"limit": 2, "cursor": page["next_cursor"]}).json()
    assert [j["id"] for j in rest["data"]] == [ids[0]]
    assert [j["id"] for j in client.get("/jobs", params={"status": "cancelled"}).json()["data"]] == [ids[0]]
    _error(client.get("/jobs", params={"status": "bogus"}), 422, "status")
    _error(client.get("/jobs", params={"cursor": "!!!"}), 422, "cursor")


def test_metrics_history_since_step(client, settings, train_id):
    job = client.post("/jobs", json=job_body(train_id)).json()
    engine = make_engine(settings.resolved_database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        from core.rows import utcnow

        # metric points are written by the attempt that holds the job: claim it first (attempt 1)
        states.claim_job(session, job_id=job["id"], device="cpu", now=utcnow(), stale_before=utcnow())
        store.add_metric_points(session, job_id=job["id"], attempt=1, points=[
            (s, s / 10, "train_loss", 1.0 / s) for s in range(1, 6)])
        # the same step written again (a resumed job) is ignored, not duplicated
        store.add_metric_points(session, job_id=job["id"], attempt=1, points=[(5, 0.5, "train_loss", 99.0)])
    engine.dispose()
    data = client.get(f"/jobs/{job['id']}/metrics", params={"since_step": 3}).json()["data"]
    assert [(p["step"], p["name"]) for p in data] == [(3, "train_loss"), (4, "train_loss"), (5, "train_loss")]
    assert data[-1]["value"] == pytest.approx(0.2)
    _error(client.get("/jobs/job_nope/metrics"), 404, None)


def test_classify_refuses_unknown_and_unfinished_models(client, train_id):
    _error(client.post("/classify", json={"model": "job_nope", "texts": ["hi"]}), 404, "model")
    job = client.post("/jobs", json=job_body(train_id)).json()
    _error(client.post("/classify", json={"model": job["id"], "texts": ["hi"]}), 422, "model")
    _error(client.post("/classify", json={"model": job["id"], "texts": []}), 422, "texts")
    _error(client.post("/classify", json={"model": job["id"], "texts": ["  "]}), 422, "texts.0")


def test_unknown_route_and_method_use_the_envelope(client):
    assert client.get("/nope").json()["error"]["code"] == "not_found"
    assert client.put("/jobs").json()["error"]["code"] == "method_not_allowed"


def test_events_and_errors_a_tenant_reads_name_no_server_paths(client, settings, train_id):
    job = client.post("/jobs", json=job_body(train_id)).json()
    home = settings.home.resolve()
    engine = make_engine(settings.resolved_database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        from core import states
        from core.rows import EventKind, JobStatus, utcnow

        row = states.claim_job(session, job_id=job["id"], device="cpu", now=utcnow(), stale_before=utcnow())
        assert row is not None
        store.add_event(session, job_id=job["id"], kind=EventKind.SAVED, attempt=1,
                        message=f"model saved to {home}/jobs/{job['id']}/model")
        states.move(session, row, JobStatus.FAILED, code="worker_error", attempt=1,
                    message="[Errno 28] No space left on device: '/tmp/trainserve-x/shard-0.safetensors'")
    engine.dispose()
    events = client.get(f"/jobs/{job['id']}/events").json()["data"]
    texts = [e["message"] for e in events] + [client.get(f"/jobs/{job['id']}").json()["error"]["message"]]
    assert f"model saved to jobs/{job['id']}/model" in texts
    assert "[Errno 28] No space left on device: 'shard-0.safetensors'" in texts
    assert not [t for t in texts if str(home) in t or "/tmp" in t]
