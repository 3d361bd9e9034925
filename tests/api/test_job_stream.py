"""Chart reads: min/max downsampling, the SSE job feed (resume, end, bounds) and dataset previews."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from app.services import job_stream
from core import states
from core.db import make_engine, make_sessionmaker, session_scope
from core.rows import JobStatus, utcnow
from core.store import jobs as store
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload


@pytest.fixture()
def factory(settings):
    engine = make_engine(settings.resolved_database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture()
def running_job(client, factory):
    train = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    job_id = client.post("/jobs", json=job_body(train)).json()["id"]
    with session_scope(factory) as session:
        states.claim_job(session, job_id=job_id, device="cpu", now=utcnow(), stale_before=utcnow())
    return job_id


def _points(factory, job_id, points):
    with session_scope(factory) as session:
        store.add_metric_points(session, job_id=job_id, attempt=1, points=points)


def _finish(factory, job_id):
    with session_scope(factory) as session:
        states.move(session, store.get_job(session, job_id=job_id), JobStatus.SUCCEEDED, message="done")


def _messages(text):
    """Parse an SSE body into (id, event, data) triples, skipping comments and the retry hint."""
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":")
                      and not line.startswith("retry"))
        if fields:
            out.append((fields.get("id"), fields["event"], json.loads(fields["data"])))
    return out


def test_downsampling_keeps_each_buckets_min_and_max(client, factory, running_job):
    values = {s: 1.0 + (s % 7) / 100 for s in range(1, 2001)}
    values[537], values[1200] = 50.0, -3.0  # a spike and a dip must survive any downsampling
    _points(factory, running_job, [(s, s / 100, "train_loss", v) for s, v in values.items()]
            + [(s, s / 100, "learning_rate", 1e-3) for s in range(1, 2001)])
    body = client.get(f"/jobs/{running_job}/metrics", params={"max_points": 100, "name": "train_loss"}).json()
    data = body["data"]
    assert body["bucket_steps"] > 1 and 50 <= len(data) <= 100
    assert {p["name"] for p in data} == {"train_loss"}
    steps = [p["step"] for p in data]
    assert steps == sorted(steps) and {537, 1200} <= set(steps)
    assert max(p["value"] for p in data) == 50.0 and min(p["value"] for p in data) == -3.0
    tail = client.get(f"/jobs/{running_job}/metrics", params={"max_points": 100, "since_step": 1950}).json()
    assert tail["bucket_steps"] == 1 and len(tail["data"]) == 2 * 51  # a short range comes back raw
    assert client.get(f"/jobs/{running_job}/metrics", params={"max_points": 5}).status_code == 422


def test_jobs_carry_their_best_evaluation_metrics(client, factory, running_job):
    _points(factory, running_job, [(10, 0.1, "eval_loss", 0.7), (20, 0.2, "eval_loss", 0.4),
                                   (30, 0.3, "eval_loss", 0.5), (10, 0.1, "eval_accuracy", 0.6),
                                   (20, 0.2, "eval_accuracy", 0.8), (30, 0.3, "eval_accuracy", 0.7)])
    assert client.get(f"/jobs/{running_job}").json()["best_metrics"] == {"eval_loss": 0.4, "eval_accuracy": 0.8}
    listed = client.get("/jobs").json()["data"]
    assert [j["best_metrics"] for j in listed if j["id"] == running_job] == [{"eval_loss": 0.4, "eval_accuracy": 0.8}]


def test_stream_sends_backlog_state_and_end_then_resumes_from_last_event_id(client, factory, running_job,
                                                                            settings, monkeypatch):
    settings.event_stream_poll_s = 0.05
    _points(factory, running_job, [(s, 0.1, "train_loss", 1.0 / s) for s in range(1, 4)])
    first_poll = threading.Event()
    read_once = job_stream.read_once

    def observed(*args, **kwargs):
        poll = read_once(*args, **kwargs)
        first_poll.set()
        return poll

    monkeypatch.setattr(job_stream, "read_once", observed)

    def later():
        assert first_poll.wait(30)
        _points(factory, running_job, [(4, 0.2, "train_loss", 0.2)])
        _finish(factory, running_job)

    threading.Thread(target=later).start()
    response = client.get(f"/jobs/{running_job}/events", params={"stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    messages = _messages(response.text)
    kinds = [m[1] for m in messages]
    assert kinds[0] == "job_event" and kinds[-1] == "end" and messages[-1][2]["status"] == "succeeded"
    steps = [p["step"] for _, kind, data in messages if kind == "metrics" for p in data["points"]]
    assert steps == [1, 2, 3, 4]  # each point once, in order, though the stream read it in two polls
    assert {m[2]["kind"] for m in messages if m[1] == "job_event"} >= {"created", "succeeded"}
    assert [m[2]["status"] for m in messages if m[1] == "state"][-1] == "succeeded"
    # Resume after the first metrics message: only what came after it is sent again.
    first_metrics_id = next(m[0] for m in messages if m[1] == "metrics")
    resumed = _messages(client.get(f"/jobs/{running_job}/events", params={"stream": True},
                                   headers={"Last-Event-ID": first_metrics_id}).text)
    resumed_steps = [p["step"] for _, kind, data in resumed if kind == "metrics" for p in data["points"]]
    assert resumed_steps == [4]
    assert "created" not in {m[2].get("kind") for m in resumed if m[1] == "job_event"}
    # since_step skips the early history of a fresh connection (the page loaded it downsampled).
    late = _messages(client.get(f"/jobs/{running_job}/events", params={"stream": True, "since_step": 3}).text)
    assert [p["step"] for _, kind, data in late if kind == "metrics" for p in data["points"]] == [3, 4]


def test_stream_refuses_bad_ids_and_a_tenant_over_its_stream_bound(client, running_job):
    # "x", and Unicode digits str.isdigit() accepts but int() refuses ('\xb2' is '²' in Latin-1: once a 500).
    for bad in (b"x", b"\xb2-1", b"1-\xb9", "٣-1".encode()):
        response = client.get(f"/jobs/{running_job}/events", params={"stream": True}, headers={"Last-Event-ID": bad})
        assert response.status_code == 422 and response.json()["error"]["field"] == "Last-Event-ID", bad
    assert client.get("/jobs/job_nope/events", params={"stream": True}).status_code == 404
    slots = client.app.state.event_streams
    for _ in range(slots.per_tenant):
        slots.acquire("tenant-a")  # streams held open by other dashboards of the same tenant
    try:
        response = client.get(f"/jobs/{running_job}/events", params={"stream": True})
        assert response.status_code == 429 and response.json()["error"]["code"] == "too_many_streams"
        assert response.headers["retry-after"]
        slots.acquire("tenant-b")  # another tenant is not affected by tenant-a's streams
        slots.release("tenant-b")
    finally:
        for _ in range(slots.per_tenant):
            slots.release("tenant-a")
    assert slots.open == {}


def test_dataset_preview_shows_the_first_rows(client):
    rows = sentiment_rows()
    dataset = upload(client, tsv_bytes(rows)).json()
    body = client.get(f"/datasets/{dataset['id']}/preview", params={"rows": 3}).json()
    assert body["columns"] == ["sentence", "label"] and body["total_rows"] == len(rows)
    assert [(r["sentence"], r["label"]) for r in body["rows"]] == [(t, str(y)) for t, y in rows[:3]]  # as parsed
    assert client.get(f"/datasets/{dataset['id']}/preview", params={"rows": 0}).status_code == 422
    assert client.get("/datasets/ds_nope/preview").status_code == 404


def test_a_feed_that_finds_no_free_slot_when_it_starts_sends_an_error_and_ends(settings):
    slots = job_stream.StreamSlots(1)
    slots.acquire("tenant-a")  # taken between the route's check and the body's start

    async def never() -> bool:
        return False

    async def collect():
        return [m async for m in job_stream.job_feed(None, settings, slots, tenant="tenant-a", job_id="job_x",
                                                     cursor=job_stream.Cursor(), since_step=0, disconnected=never)]

    messages = asyncio.run(collect())
    assert len(messages) == 1 and messages[0].startswith("id: 0-0\nevent: error\n")
    assert json.loads(messages[0].split("data: ", 1)[1])["error"]["code"] == "too_many_streams"
    assert slots.open == {"tenant-a": 1}  # the slot it did not get is not given back either
