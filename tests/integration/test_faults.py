"""Fault injection with real processes: Redis losing its data mid-job, PostgreSQL restarting (private servers)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from app.main import create_app
from core.migrate import upgrade
from tests.conftest import make_key
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload
from tests.integration.conftest import wait_for
from tests.pg_server import PostgresServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_redis_losing_its_data_loses_no_job(settings, worker_env, start_worker, tiny_bert_dir, private_redis):
    settings.redis_url = private_redis.url
    worker_env.update(TRAINSERVE_REDIS_URL=private_redis.url, TRAINSERVE_HEARTBEAT_TIMEOUT_S="6")
    with TestClient(create_app(settings=settings)) as client:
        client.headers["Authorization"] = f"Bearer {make_key(settings.resolved_database_url)}"
        start_worker("training")
        ds = upload(client, tsv_bytes(sentiment_rows(4))).json()["id"]
        hp = {"max_steps": 120, "batch_size": 8, "learning_rate": 1e-2, "max_length": 32}
        body = job_body(ds, base_model=str(tiny_bert_dir), hyperparameters=hp)
        running = client.post("/jobs", json=body).json()["id"]
        queued = client.post("/jobs", json=body).json()["id"]  # waits behind the first: one worker
        wait_for(lambda: client.get(f"/jobs/{running}").json()["progress"]["step"] >= 10, 120, "step 10")
        private_redis.kill()
        private_redis.start()  # empty: the second job's message is gone
        for job_id in (running, queued):
            job = wait_for(lambda j=job_id: (r := client.get(f"/jobs/{j}").json())["status"]
                           in ("succeeded", "failed") and r, 300, f"{job_id} to finish")
            assert job["status"] == "succeeded", job["error"]


@pytest.fixture()
def restartable_postgres(settings):
    """A private PostgreSQL cluster, migrated, that this test may stop: the shared server never goes down."""
    server = PostgresServer()
    try:
        server.start()
        admin = create_engine(server.url(), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text('CREATE DATABASE "trainserve"'))
        admin.dispose()
        upgrade(server.url("trainserve"))
        settings.database_url = server.url("trainserve")
        yield server
    finally:
        server.remove()


def test_postgres_restart_gives_503_then_recovers(settings, restartable_postgres):
    postgres = restartable_postgres
    with TestClient(create_app(settings=settings)) as client:
        client.headers["Authorization"] = f"Bearer {make_key(settings.resolved_database_url)}"
        assert client.get("/jobs").status_code == 200
        postgres.stop()
        try:
            for path in ("/jobs", "/datasets", "/health"):
                response = client.get(path)
                assert response.status_code == 503, (path, response.text)
                assert "retry-after" in response.headers or path == "/health"
            response = client.post("/datasets", files={"file": ("t.tsv", tsv_bytes(sentiment_rows()))})
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "database_unavailable"
        finally:
            postgres.start()
        wait_for(lambda: client.get("/health").status_code == 200, 60, "the API to see the database again")
        assert client.get("/jobs").status_code == 200
        assert client.post("/datasets", files={"file": ("t.tsv", tsv_bytes(sentiment_rows()))}).status_code == 201
        assert len(client.get("/datasets").json()["data"]) == 1  # the refused upload left nothing behind
