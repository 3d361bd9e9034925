"""Training workers report their device to Redis while they live; a job too big for a worker's device fails there."""

from __future__ import annotations

import time

import pytest

from core import capacity
from core.redis_keys import CAPACITY_PREFIX, capacity_key
from tests.conftest import RecordingQueue
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload
from tests.tiny_models import build_tiny_bert
from worker.context import WorkerContext
from worker.jobs.capacity import measure, start_reporting


@pytest.fixture()
def ctx(settings):
    settings.worker_device = "cpu"
    context = WorkerContext(settings, RecordingQueue())
    for key in context.redis.scan_iter(match=CAPACITY_PREFIX + "*"):
        context.redis.delete(key)
    yield context
    context.shutdown.set()
    context.close()


def test_a_training_worker_reports_while_it_lives_and_withdraws_at_shutdown(ctx, monkeypatch):
    monkeypatch.setenv("TRAINSERVE_WORKER_QUEUES", "training,inference")
    ctx.settings.capacity_ttl_s = 0.6
    ctx.settings.worker_memory_bytes = 3 * 1024**3
    reporter = start_reporting(ctx)
    assert reporter is not None
    key = capacity_key(reporter.report.worker)
    assert 0 < ctx.redis.pttl(key) <= 600
    time.sleep(1.5)  # past the TTL: only the refreshes keep it alive
    (report,) = capacity.reported(ctx.redis)
    assert (report.device, report.total_bytes) == ("cpu", 3 * 1024**3)
    assert capacity.largest_device(ctx.settings.resolved_redis_url) == report
    ctx.shutdown.set()
    reporter.join(timeout=5)
    assert capacity.reported(ctx.redis) == []


def test_without_the_setting_a_cpu_worker_reports_its_ram_and_other_workers_report_nothing(ctx, monkeypatch):
    report = measure(ctx)
    assert report.device == "cpu" and report.total_bytes > 256 * 1024**2
    monkeypatch.setenv("TRAINSERVE_WORKER_QUEUES", "generation")
    assert start_reporting(ctx) is None and capacity.reported(ctx.redis) == []


def test_a_job_too_big_for_this_worker_fails_with_does_not_fit(client, ctx, tmp_path):
    from worker.jobs.lifecycle import run_training_job

    train = upload(client, tsv_bytes(sentiment_rows(2))).json()["id"]
    body = job_body(train, base_model=str(build_tiny_bert(tmp_path / "bert")), hyperparameters={"max_steps": 1})
    job_id = client.post("/jobs", json=body).json()["id"]  # admitted: it fits the assumed device
    ctx.settings.worker_memory_bytes = 1024**3  # less than the runtime allowance alone
    assert run_training_job(ctx, job_id) == "failed"
    job = client.get(f"/jobs/{job_id}").json()
    assert job["error"]["code"] == "does_not_fit", job["error"]
    assert "more than cpu on this worker has (1.1 GB)" in job["error"]["message"]
    assert job["artifacts"] == []
