"""Request ids (accepted, generated, returned, sent with task messages) and the API's /metrics."""

from __future__ import annotations

import json
import logging

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from core.db import make_engine, make_sessionmaker, session_scope
from core.logs import REQUEST_ID_HEADER, ContextFilter, JsonFormatter, bound
from core.store import outbox
from tests.conftest import ROOT, make_key
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_request_id_is_echoed_generated_and_replaced_when_unsafe(client):
    given = client.get("/jobs", headers={"X-Request-ID": "abc-123.x"})
    assert given.headers["x-request-id"] == "abc-123.x"
    fresh = client.get("/jobs").headers["x-request-id"]
    assert fresh.startswith("req-") and fresh != client.get("/jobs").headers["x-request-id"]
    unsafe = client.get("/jobs", headers={"X-Request-ID": "a b\"}{" + "x" * 200}).headers["x-request-id"]
    assert unsafe.startswith("req-")
    # Errors carry it too (the envelope is written by a handler, after routing).
    assert client.get("/jobs/job_nope", headers={"X-Request-ID": "r-404"}).headers["x-request-id"] == "r-404"


def test_the_request_id_travels_with_the_training_task_message(client, queue, settings):
    train_id = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    response = client.post("/jobs", json=job_body(train_id), headers={"X-Request-ID": "trace-job-1"})
    assert response.status_code == 201, response.text
    assert queue.headers[-1] == {REQUEST_ID_HEADER: "trace-job-1"}
    # A requeue outside any request (the reaper's) keeps the job's request id.
    engine = make_engine(settings.resolved_database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        message = outbox.add_train(session, job_id=response.json()["id"], devices=1)
        assert message.headers == {REQUEST_ID_HEADER: "trace-job-1"}
    engine.dispose()


def test_json_lines_carry_the_bound_ids():
    record = logging.LogRecord("worker.x", logging.INFO, __file__, 1, "step %d", (3,), None)
    with bound(request_id="r-1", job_id="job_1"):
        ContextFilter().filter(record)
        line = JsonFormatter().format(record)
    entry = json.loads(line)
    assert entry["message"] == "step 3" and entry["request_id"] == "r-1" and entry["job_id"] == "job_1"
    assert entry["level"] == "INFO" and entry["logger"] == "worker.x"


def test_metrics_count_by_route_template_and_report_job_states(client, settings):
    train_id = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    job = client.post("/jobs", json=job_body(train_id)).json()
    for _ in range(3):
        assert client.get(f"/jobs/{job['id']}").status_code == 200
    client.get("/no/such/path/123")
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = _samples(response.text)
    key = ("trainserve_http_requests_total", (("method", "GET"), ("route", "/jobs/{job_id}"), ("status", "200")))
    assert samples[key] == 3
    assert not any(job["id"] in str(labels) for _, labels in samples)  # raw paths never become labels
    assert samples[("trainserve_http_requests_total",
                    (("method", "GET"), ("route", "<unmatched>"), ("status", "404")))] == 1
    assert samples[("trainserve_jobs", (("status", "queued"),))] == 1
    assert samples[("trainserve_jobs", (("status", "running"),))] == 0
    assert samples[("trainserve_queue_depth", ())] == 1
    assert samples[("trainserve_queue_oldest_wait_seconds", ())] >= 0
    assert ("trainserve_broker_queue_length", (("queue", "training"),)) in samples


def test_metrics_can_require_an_admin_key(client, settings):
    settings.metrics_require_key = True
    client.headers.pop("Authorization")
    assert client.get("/metrics").status_code == 401
    user = make_key(settings.resolved_database_url, tenant="t")
    assert client.get("/metrics", headers={"Authorization": f"Bearer {user}"}).status_code == 401
    admin = make_key(settings.resolved_database_url, admin=True)
    assert client.get("/metrics", headers={"Authorization": f"Bearer {admin}"}).status_code == 200


def test_every_metric_the_grafana_dashboard_queries_exists(client):
    """The dashboard's PromQL names families the API or a worker really exports (counters as `_total`)."""
    import re

    from core.settings import Settings
    from worker.metrics import REGISTRY

    dashboard = json.loads((ROOT / "deploy" / "grafana" / "trainserve.json").read_text())
    queried = {re.sub(r"_(bucket|sum|count)$", "", name)
               for panel in dashboard["panels"] for target in panel.get("targets", [])
               for name in re.findall(r"trainserve_\w+", target["expr"])}
    exported = {}
    for text in (client.get("/metrics").text, generate_latest(REGISTRY).decode()):
        for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M):
            exported[name.removesuffix("_total") + ("_total" if kind == "counter" else "")] = kind
    assert queried and queried <= set(exported), sorted(queried - set(exported))
    assert Settings().worker_metrics_port == 0  # off unless configured: no port opened by surprise
