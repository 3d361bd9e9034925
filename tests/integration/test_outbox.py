"""The outbox with a real broker: a job submitted while Redis is down is sent by the relay once it is back."""

from __future__ import annotations

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient

from app.main import create_app
from core.db import make_engine, make_sessionmaker
from core.store import outbox
from core.tasks import QUEUE_TRAIN
from tests.conftest import make_key
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload
from tests.integration.conftest import wait_for

pytestmark = [pytest.mark.integration]


def test_relay_sends_what_a_stopped_broker_refused(settings, private_redis):
    settings.redis_url = private_redis.url
    settings.outbox_interval_s = 0.5
    engine = make_engine(settings.resolved_database_url)
    factory = make_sessionmaker(engine)
    with TestClient(create_app(settings=settings)) as client:  # the real Celery task queue, and its relay thread
        client.headers["Authorization"] = f"Bearer {make_key(settings.resolved_database_url)}"
        dataset = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
        private_redis.kill()
        response = client.post("/jobs", json=job_body(dataset))
        assert response.status_code == 201, response.text
        job_id = response.json()["id"]
        assert client.get(f"/jobs/{job_id}").json()["status"] == "queued"
        with factory() as session:
            [waiting] = outbox.unsent(session, job_id=job_id)
            assert waiting.attempts >= 1 and waiting.last_error
        private_redis.start()

        def delivered() -> bool:
            with factory() as session:
                return not outbox.unsent(session, job_id=job_id)

        wait_for(delivered, 60, "the relay to send the job's message")
        broker = redis_lib.Redis.from_url(private_redis.url)
        assert broker.llen(QUEUE_TRAIN) == 1  # exactly one task message waits on the training queue
        broker.close()
        assert client.get(f"/jobs/{job_id}").json()["status"] == "queued"
    engine.dispose()
