"""Keys, tenants, idempotency and limits."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import make_key
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload
from tests.tiny_lm import build_tiny_gpt2

PUBLIC = {"/health", "/docs", "/openapi.json", "/redoc", "/docs/oauth2-redirect"}


def _routes(client):
    """Every operation in the OpenAPI document (what clients can call)."""
    for path, operations in client.app.openapi()["paths"].items():
        for method in operations:
            yield method.upper(), path


def test_every_route_but_health_and_docs_needs_a_key(client):
    from fastapi.testclient import TestClient

    anonymous = TestClient(client.app)  # same running app, no default Authorization header
    checked = 0
    for method, path in _routes(client):
        if path in PUBLIC:
            continue
        url = re.sub(r"\{[^}]+\}", "x", path)
        for headers in ({}, {"Authorization": "Bearer ts_wrong"}, {"Authorization": "Basic abc"}):
            response = anonymous.request(method, url, headers=headers)
            assert response.status_code == 401, (method, path, headers, response.text)
            assert response.json()["error"]["code"] == "unauthorized"
            assert response.headers["www-authenticate"] == "Bearer"
        checked += 1
    assert checked >= 10
    assert anonymous.get("/health").status_code == 200
    assert anonymous.get("/openapi.json").status_code == 200


def test_revoked_key_stops_working(client, settings):
    from core.auth import revoke_key
    from core.db import make_engine, make_sessionmaker, session_scope
    from core.rows import ApiKey

    raw = make_key(settings.resolved_database_url, name="temp")
    assert client.get("/jobs", headers={"Authorization": f"Bearer {raw}"}).status_code == 200
    engine = make_engine(settings.resolved_database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        row = session.query(ApiKey).filter_by(name="temp").one()
        assert row.key_hash != raw and raw not in row.key_hash  # only the hash is stored
        revoke_key(session, key_id=row.id)
    engine.dispose()
    assert client.get("/jobs", headers={"Authorization": f"Bearer {raw}"}).status_code == 401


def _stored_response(settings) -> str:
    """A response of tenant-a, kept as POST /v1/responses keeps one (no generation needed to own it)."""
    from core.db import make_engine, make_sessionmaker, session_scope
    from core.store.responses import keep_response

    engine = make_engine(settings.resolved_database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        keep_response(session, response_id="resp_" + "1" * 24, tenant="tenant-a", model="tiny",
                      previous_response_id=None, context=[], input_items=[], body={}, retention_s=60)
    engine.dispose()
    return "resp_" + "1" * 24


def test_other_tenants_get_404_on_every_route_with_an_id(client, settings, queue):
    ds = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    job = client.post("/jobs", json=job_body(ds)).json()["id"]
    settings.webhook_allow_private = True
    hook = client.post("/webhooks", json={"url": "http://127.0.0.1:9/hook", "event_types": ["job.failed"]}).json()
    other = {"Authorization": f"Bearer {make_key(settings.resolved_database_url, tenant='tenant-b')}"}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "x"}}
    requests = client.post("/v1/files", files={"file": ("b.jsonl", json.dumps(line).encode())},
                           data={"purpose": "batch"}).json()["id"]
    batch = client.post("/v1/batches", json={"input_file_id": requests, "endpoint": "/v1/completions"}).json()["id"]
    build_tiny_gpt2(settings.home / "models" / "tiny", n_positions=64)
    evaluation = client.post("/v1/evals", json={"data_source_config": {"type": "custom", "item_schema": {}},
                                                "testing_criteria": [{"type": "string_check", "name": "c",
                                                                      "input": "a", "reference": "a",
                                                                      "operation": "eq"}]}).json()["id"]
    run_body = {"data_source": {"type": "completions", "model": "tiny", "input_messages": {
        "type": "template", "template": [{"role": "user", "content": "hi"}]},
        "source": {"type": "file_content", "content": [{"item": {}}]}}}
    run = client.post(f"/v1/evals/{evaluation}/runs", json=run_body).json()["id"]
    assert client.post("/aliases", json={"name": "bot:prod", "target": "tiny"}).status_code == 201
    stored = _stored_response(settings)
    ids = {"response_id": stored, "dataset_id": ds, "job_id": job, "artifact_id": "art_x", "endpoint_id": hook["id"],
           "sweep_id": "swp_x", "file_id": ds, "batch_id": batch, "eval_id": evaluation, "run_id": run,
           "item_id": "outitem_" + "0" * 24, "name": "bot:prod"}
    bodies = {"/v1/evals/{eval_id}": {}, "/v1/evals/{eval_id}/runs": run_body,
              "/aliases/{name}/move": {"target": "tiny"}}  # a valid body: the 404 is the owner check's
    checked = 0
    for method, path in _routes(client):
        names = re.findall(r"\{([^}]+)\}", path)
        if not names:
            continue
        url = path.format(**{name: ids[name] for name in names})
        body = bodies.get(path) if method == "POST" else None
        response = client.request(method, url, headers=other, json=body)
        assert response.status_code == 404, (method, path, response.text)
        checked += 1
    assert checked >= 7
    assert client.get("/jobs", headers=other).json()["data"] == []
    assert client.get("/datasets", headers=other).json()["data"] == []
    # referencing another tenant's dataset in a body is refused as if it did not exist
    response = client.post("/jobs", json=job_body(ds), headers=other)
    assert response.status_code == 422 and response.json()["error"]["field"] == "train_dataset"
    response = client.post("/classify", json={"model": job, "texts": ["x"]}, headers=other)
    assert response.status_code == 404 and response.json()["error"]["field"] == "model"
    # the owner still sees everything, and an admin key sees every tenant
    assert client.get(f"/jobs/{job}").status_code == 200
    admin = {"Authorization": f"Bearer {make_key(settings.resolved_database_url, admin=True)}"}
    assert client.get(f"/jobs/{job}", headers=admin).status_code == 200


def test_idempotent_job_creation(client, queue):
    ds = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    headers = {"Idempotency-Key": "create-job-1"}
    first = client.post("/jobs", json=job_body(ds), headers=headers)
    again = client.post("/jobs", json=job_body(ds), headers=headers)
    assert first.status_code == again.status_code == 201
    assert first.json()["id"] == again.json()["id"]
    assert len(queue.sent) == 1 and len(client.get("/jobs").json()["data"]) == 1
    changed = client.post("/jobs", json=job_body(ds, metadata={"x": "y"}), headers=headers)
    assert changed.status_code == 409 and changed.json()["error"]["field"] == "Idempotency-Key"
    bad = client.post("/jobs", json=job_body(ds), headers={"Idempotency-Key": "bad key"})
    assert bad.status_code == 422


def test_idempotent_dataset_upload(client, settings):
    content = tsv_bytes(sentiment_rows())
    headers = {"Idempotency-Key": "upload-1"}
    first = client.post("/datasets", files={"file": ("t.tsv", content)}, headers=headers)
    again = client.post("/datasets", files={"file": ("t.tsv", content)}, headers=headers)
    assert first.status_code == again.status_code == 201 and first.json()["id"] == again.json()["id"]
    assert len(list((settings.home / "datasets").glob("*"))) == 1
    other = client.post("/datasets", files={"file": ("t.tsv", content + b"more\t1\n")}, headers=headers)
    assert other.status_code == 409


def test_idempotency_keys_are_per_tenant(client, settings):
    ds = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    client.post("/jobs", json=job_body(ds), headers={"Idempotency-Key": "k"})
    other = {"Authorization": f"Bearer {make_key(settings.resolved_database_url, tenant='tenant-b')}",
             "Idempotency-Key": "k"}
    ds_b = client.post("/datasets", files={"file": ("t.tsv", tsv_bytes(sentiment_rows()))}, headers=other)
    assert ds_b.status_code == 201


def test_per_tenant_cap_on_active_jobs(client, settings):
    settings.max_active_jobs_per_tenant = 2
    ds = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    assert [client.post("/jobs", json=job_body(ds)).status_code for _ in range(2)] == [201, 201]
    refused = client.post("/jobs", json=job_body(ds))
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "quota_exceeded"
    assert int(refused.headers["retry-after"]) >= 1


def test_body_limits(client, settings):
    settings.max_request_bytes = 200
    response = client.post("/jobs", json=job_body("ds_x", metadata={"pad": "x" * 300}))
    assert response.status_code == 413 and response.json()["error"]["code"] == "payload_too_large"

    def chunks():
        yield b'{"model": "job_x", "texts": ["'
        yield b"y" * 400
        yield b'"]}'

    response = client.post("/classify", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413


@pytest.mark.parametrize("path", ["/etc", "/tmp/../etc/ssl", "~/.ssh"])
def test_local_models_outside_allowed_roots_are_refused(client, path):
    ds = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    response = client.post("/jobs", json=job_body(ds, base_model=path))
    assert response.status_code == 422 and response.json()["error"]["field"] == "base_model"
    assert "allowed folder" in response.json()["error"]["message"]
