"""Webhooks end to end: a real worker trains a job while the receiver is down (503, then refusing connections);
once it is back it has every event exactly once by id, each signed per Standard Webhooks."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from standardwebhooks import Webhook

from app.main import create_app
from tests.conftest import make_key
from tests.factories import sentiment_rows, tsv_bytes, upload
from tests.integration.conftest import wait_for
from tests.webhook_receiver import Receiver

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(360)]

JOB_EVENTS = ["job.queued", "job.started", "job.checkpoint", "job.succeeded", "job.failed", "job.cancelled"]


def test_a_receiver_that_was_down_gets_every_event_once_signed(settings, worker_env, start_worker, tiny_bert_dir):
    settings.webhook_allow_private = True  # the receiver is on 127.0.0.1
    worker_env.update(TRAINSERVE_WEBHOOK_ALLOW_PRIVATE="1", TRAINSERVE_WEBHOOK_INTERVAL_S="0.2",
                      TRAINSERVE_WEBHOOK_BACKOFF_S="0.2", TRAINSERVE_WEBHOOK_MAX_BACKOFF_S="1")
    receiver = Receiver(status=503).start()
    with TestClient(create_app(settings=settings)) as api:  # the real Celery queue
        api.headers["Authorization"] = f"Bearer {make_key(settings.resolved_database_url, tenant='team-a')}"
        endpoint = api.post("/webhooks", json={"url": receiver.url, "event_types": JOB_EVENTS}).json()
        dataset = upload(api, tsv_bytes(sentiment_rows(2))).json()["id"]
        job_id = api.post("/jobs", json={
            "base_model": str(tiny_bert_dir), "train_dataset": dataset, "text_column": "sentence",
            "hyperparameters": {"max_steps": 6, "batch_size": 8, "max_length": 16}}).json()["id"]
        start_worker()  # checkpoints every 5 steps (worker_env)
        wait_for(lambda: api.get(f"/jobs/{job_id}").json()["status"] == "succeeded", 180, "the job to succeed")

        def log() -> list[dict]:
            return api.get(f"/webhooks/{endpoint['id']}/deliveries", params={"limit": 100}).json()["data"]

        wait_for(lambda: len(log()) >= 4 and all(d["attempts"] >= 2 for d in log()), 30, "503s for every event")
        receiver.stop()  # now connections are refused
        wait_for(lambda: any(a["error"] and "Connect" in a["error"] for d in log() for a in d["attempt_log"]), 30,
                 "an attempt on the refused port")
        receiver.status = 200
        receiver.start()
        wait_for(lambda: all(d["status"] == "delivered" for d in log()), 30, "every delivery to succeed")
        deliveries = {d["event_id"]: d for d in log()}

    accepted = receiver.accepted()
    bodies = [Webhook(endpoint["secret"]).verify(r.body, r.headers) for r in accepted]
    ids = [r.headers["webhook-id"] for r in accepted]
    assert len(ids) == len(set(ids)) == len(deliveries), ids  # exactly once by id
    types = [b["type"] for b in bodies]
    assert set(types) == {"job.queued", "job.started", "job.checkpoint", "job.succeeded"}, types
    assert types.count("job.queued") == types.count("job.started") == types.count("job.succeeded") == 1
    assert all(b["data"]["id"] == job_id for b in bodies)
    refused = [r.headers["webhook-id"] for r in receiver.requests if r.answered == 503]
    assert set(refused) == set(ids)  # every redelivery carried the event's first id
    assert set(deliveries) == set(ids)
    codes = [[a["status_code"] for a in d["attempt_log"]] for d in deliveries.values()]
    assert all(c[0] == 503 and c[-1] == 200 for c in codes), codes  # refused with 503s, then delivered
    assert any(None in c for c in codes), codes  # and tried while nothing listened
    assert all(a["duration_ms"] >= 0 for d in deliveries.values() for a in d["attempt_log"])

