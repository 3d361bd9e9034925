"""Heartbeats, the reaper, broker-loss recovery and the cancel watchdog, on real PostgreSQL and Redis."""

from __future__ import annotations

from datetime import timedelta

import pytest
import redis

from core import states
from core.db import session_scope
from core.redis_keys import BROKER_SENTINEL
from core.rows import Job, JobStatus, utcnow
from core.tasks import QUEUE_TRAIN, TASK_TRAIN
from tests.conftest import INTEGRATION_REDIS, RecordingQueue
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload
from worker.jobs.recovery import EXIT_CANCEL_TIMEOUT, Heartbeat, reap, recover_broker


@pytest.fixture()
def job_id(client):
    ds = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    return client.post("/jobs", json=job_body(ds)).json()["id"]


def _set(factory, job_id, **values):
    with session_scope(factory) as session:
        job = session.get(Job, job_id)
        for key, value in values.items():
            setattr(job, key, value)


def _claim(factory, job_id, settings):
    now = utcnow()
    with session_scope(factory) as session:
        return states.claim_job(session, job_id=job_id, device="cpu", now=now,
                               stale_before=now - timedelta(seconds=settings.heartbeat_timeout_s))


def test_claim_is_exclusive_while_the_holder_beats(factory, job_id, settings):
    assert _claim(factory, job_id, settings) is not None
    assert _claim(factory, job_id, settings) is None  # a duplicate message while the first worker is alive
    _set(factory, job_id, heartbeat_at=utcnow() - timedelta(seconds=settings.heartbeat_timeout_s + 5))
    again = _claim(factory, job_id, settings)  # redelivered after the first worker died
    assert again is not None and again.attempts == 2
    _set(factory, job_id, status=JobStatus.SUCCEEDED)
    assert _claim(factory, job_id, settings) is None


def test_reaper_requeues_silent_jobs_then_fails_them_past_the_limit(client, factory, job_id, settings):
    queue = RecordingQueue()
    assert _claim(factory, job_id, settings) is not None
    assert reap(factory, settings, queue) == []  # fresh heartbeat: left alone
    _set(factory, job_id, heartbeat_at=utcnow() - timedelta(hours=1))
    assert reap(factory, settings, queue) == [job_id] and queue.sent == [(TASK_TRAIN, [job_id], QUEUE_TRAIN)]
    job = client.get(f"/jobs/{job_id}").json()
    assert job["status"] == "queued"
    assert client.get(f"/jobs/{job_id}/events").json()["data"][-1]["kind"] == "requeued"
    _set(factory, job_id, status=JobStatus.RUNNING, attempts=settings.max_attempts,
         heartbeat_at=utcnow() - timedelta(hours=1))
    assert reap(factory, settings, queue) == []
    job = client.get(f"/jobs/{job_id}").json()
    assert job["status"] == "failed" and job["error"]["code"] == "worker_lost"


def test_broker_that_lost_its_data_gets_queued_jobs_again(factory, job_id, settings):
    settings.redis_url = INTEGRATION_REDIS  # this worker's database that every test using it empties first
    client = redis.Redis.from_url(settings.redis_url)
    client.flushdb()  # as after a restart without persistence
    queue = RecordingQueue()
    assert recover_broker(factory, settings, queue) == [job_id]
    assert queue.sent == [(TASK_TRAIN, [job_id], QUEUE_TRAIN)]
    assert client.exists(BROKER_SENTINEL)
    assert recover_broker(factory, settings, queue) == []  # sentinel present: nothing lost
    client.flushdb()
    client.close()


def test_watchdog_ends_the_process_when_a_cancel_is_ignored(client, factory, job_id, settings):
    exits: list[int] = []
    assert _claim(factory, job_id, settings) is not None
    beat = Heartbeat(factory, settings, job_id, attempt=1, exit_process=exits.append)
    beat.tick()
    assert exits == []
    _set(factory, job_id, cancel_requested_at=utcnow() - timedelta(seconds=settings.cancel_grace_s + 1))
    beat.tick()
    assert exits == [EXIT_CANCEL_TIMEOUT]
    job = client.get(f"/jobs/{job_id}").json()
    assert job["status"] == "cancelled"


def test_heartbeat_notices_a_newer_attempt_took_the_job(factory, job_id, settings):
    assert _claim(factory, job_id, settings) is not None
    beat = Heartbeat(factory, settings, job_id, attempt=1, exit_process=lambda code: None)
    beat.tick()
    assert not beat.lost.is_set()
    _set(factory, job_id, attempts=2)  # the reaper requeued it and another worker claimed it
    beat.tick()
    assert beat.lost.is_set()
