"""Property-based fuzzing of the OpenAPI document (schemathesis): no 5xx, responses match the schema."""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from sqlalchemy import create_engine, text

from tests.conftest import make_key
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload


@pytest.fixture()
def fuzz_target(client, settings):
    # No worker runs here: a request that reaches one (a grader's embeddings or judge call to a real model name)
    # waits out its timeout, so those are short; the answer is then a 504/503, never a 500.
    settings.embedding_timeout_s = settings.classify_timeout_s = 1.0
    settings.generation_wait_s, settings.generation_timeout_s = 1.0, 2.0
    # A real dataset so generated job bodies can reach deeper validation, not only "unknown dataset".
    upload(client, tsv_bytes(sentiment_rows()), name="fuzz")
    return client.app, make_key(settings.resolved_database_url, tenant="fuzz")


def test_no_server_errors_and_schema_conformance(fuzz_target):
    """Every operation, 25 generated requests each (bounded so CI stays fast)."""
    app, key = fuzz_target
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case):
            case.call_and_validate(headers={"Authorization": f"Bearer {key}"}, checks=checks)

        run()


# The edges plain schema fuzzing does not reach: integers past 2**63 and past Python's 4,300-digit parsing
# limit, Unicode digits ('²'.isdigit() is True, int('²') fails), deep nesting, and a dataset deleted while a
# job that uses it is being created.
EDGE_NUMBERS = ["9" * 5000, str(2**31), str(2**63 - 1), str(2**63), str(2**64), str(-(2**63) - 1), "1e400", "-0"]
UNICODE_DIGITS = "²³¹¼½٣۵०১௫๑០０𝟎"
edge_literal = st.one_of(
    st.sampled_from(EDGE_NUMBERS),
    st.text(alphabet=UNICODE_DIGITS + "-", min_size=1, max_size=4).map(json.dumps),
    # Depths around the limits that matter: pydantic's serializer (a few hundred), json's parser (about 1000).
    st.sampled_from([20, 300, 900, 990, 5000]).map(lambda depth: "[" * depth + "1" + "]" * depth),
    st.sampled_from([20, 300, 900, 990, 5000]).map(lambda depth: '{"a": ' * depth + "1" + "}" * depth),
)
FREE_FORM = ("hyperparameters", "model_config", "metadata")
PLACEHOLDER = "__edge__"


def _integer_query_parameters(app) -> dict[tuple[str, str], list[str]]:
    """(METHOD, path template) -> names of its integer query parameters, from the OpenAPI document."""
    found: dict[tuple[str, str], list[str]] = {}
    for path, item in app.openapi()["paths"].items():
        for method, operation in item.items():
            names = [p["name"] for p in operation.get("parameters", [])
                     if p["in"] == "query" and "integer" in json.dumps(p.get("schema", {}))]
            found[(method.upper(), path)] = names
    return found


def _with_edge(body, key: str):
    """The body as JSON text with the value at `key` (inside it for free-form objects) replaced by the edge."""
    if not isinstance(body, dict):
        return json.dumps(PLACEHOLDER)
    body = dict(body)
    if key in FREE_FORM:
        target = body.get(key) if isinstance(body.get(key), dict) else {}
        body[key] = {**target, next(iter(target), "epochs"): PLACEHOLDER}
    else:
        body[key] = PLACEHOLDER
    return json.dumps(body)


def test_fuzz_learns_the_edges(fuzz_target, client):
    """Every operation with edge integers in its query and edge values spliced into its JSON body: no 5xx."""
    app, key = fuzz_target
    client._transport.raise_server_exceptions = False
    limit = app.state.settings.max_request_bytes = 64 * 1024  # a body labelled multipart/... passes it quickly
    headers = {"Authorization": f"Bearer {key}"}
    dataset = client.post("/datasets", files={"file": ("t.tsv", tsv_bytes(sentiment_rows()))}, headers=headers)
    # Generated bodies rarely pass validation as a whole; an edge spliced into a valid one reaches the service.
    valid = {("POST", "/jobs"): job_body(dataset.json()["id"])}
    integer_params = _integer_query_parameters(app)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    for operation in [result.ok() for result in schema.get_all_operations()]:
        route = (operation.method.upper(), operation.path)
        _edge_fuzzer(operation, integer_params.get(route, []), valid.get(route), client, key, limit)()


def _edge_fuzzer(operation, names: list[str], valid, client, key: str, limit: int):
    @given(case=operation.as_strategy(), edge=edge_literal, number=st.sampled_from(EDGE_NUMBERS),
           field=st.sampled_from([*FREE_FORM, "texts", "seed", "epochs", "max_new_tokens"]),
           claim_multipart=st.booleans(), use_valid=st.booleans())
    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case, edge, number, field, claim_multipart, use_valid):
        headers = {"Authorization": f"Bearer {key}"}
        query = {**(case.query or {}), **{name: number for name in names}}
        content = None
        if case.media_type == "application/json":
            base = valid if use_valid and valid is not None else case.body
            content = _with_edge(base, field).replace(json.dumps(PLACEHOLDER), edge)
            headers["content-type"] = "application/json"
            if claim_multipart:  # a JSON route must keep the JSON limit whatever the label says
                headers["content-type"] = "multipart/form-data; boundary=x"
                content += " " * limit
        response = client.request(case.method, case.formatted_path, params=query, content=content, headers=headers)
        assert response.status_code < 500, (case.method, case.formatted_path, response.text[:300])
        if response.status_code >= 400:
            assert set(response.json()) == {"error"} and response.json()["error"]["message"]

    return run


def test_fuzz_unicode_digit_labels_and_concurrent_delete(client, monkeypatch):
    """Random label cells (Unicode digits among them), with the dataset deleted mid-request half the time."""
    client._transport.raise_server_exceptions = False
    from app.services import job_methods
    resolve = job_methods.resolve_base_model
    doomed: list[str] = []

    def resolve_while_deleting(*args, **kwargs):
        if doomed:  # another client deletes the dataset between the checks and the insert
            engine = create_engine(client.app.state.settings.resolved_database_url)
            with engine.begin() as conn:
                conn.execute(text("DELETE FROM datasets WHERE id = :id"), {"id": doomed.pop()})
            engine.dispose()
        return resolve(*args, **kwargs)

    monkeypatch.setattr(job_methods, "resolve_base_model", resolve_while_deleting)

    @given(labels=st.lists(st.text(alphabet=UNICODE_DIGITS + "0123456789-+ ", min_size=1, max_size=4),
                           min_size=2, max_size=6),
           delete=st.booleans())
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(labels, delete):
        rows = [(f"text {i}", label.replace("\t", " ")) for i, label in enumerate(labels)]
        uploaded = upload(client, tsv_bytes(rows))
        assert uploaded.status_code in (201, 422), uploaded.text
        if uploaded.status_code != 201:
            return
        dataset = uploaded.json()["id"]
        if delete:
            doomed.append(dataset)
        response = client.post("/jobs", json=job_body(dataset))
        assert response.status_code in (201, 409, 422), response.text
        if delete:
            assert response.status_code in (409, 422), response.text
            doomed.clear()
        if response.status_code == 409:
            assert response.json()["error"]["field"] == "train_dataset"
        if response.status_code == 201:  # stay under the per-tenant active-job quota across examples
            assert client.post(f"/jobs/{response.json()['id']}/cancel").status_code == 200

    run()


# Every JSON type, for fields that expect another one (`stop: 5` once reached list(5) and a 500).
WRONG_TYPES = [5, True, 1.5, [1], ["a"] * 5, {"a": 1}, None, "²"]
DIGIT_HEADER = st.text(alphabet=UNICODE_DIGITS + "0123456789-", min_size=1, max_size=12)


def _body_fields(app) -> dict[tuple[str, str], list[str]]:
    """(METHOD, path template) -> the top-level fields of its JSON body, from the OpenAPI document."""
    document = app.openapi()
    found: dict[tuple[str, str], list[str]] = {}
    for path, item in document["paths"].items():
        for method, operation in item.items():
            schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            ref = schema.get("$ref") or next((s["$ref"] for s in schema.get("anyOf", []) if "$ref" in s), None)
            if ref:
                found[(method.upper(), path)] = sorted(document["components"]["schemas"][ref.rsplit("/", 1)[1]]
                                                       .get("properties", {}))
    return found


def _header_params(app) -> dict[tuple[str, str], list[str]]:
    return {(method.upper(), path): [p["name"] for p in operation.get("parameters", []) if p["in"] == "header"]
            for path, item in app.openapi()["paths"].items() for method, operation in item.items()}


def test_fuzz_wrong_json_types_for_every_field_and_unicode_digits_in_headers(fuzz_target, client):
    """Each body field of each operation given every other JSON type, and header parameters given Unicode
    digits (streams asked for, so Last-Event-ID is parsed): always a 4xx envelope, never a 5xx or a reset."""
    app, key = fuzz_target
    client._transport.raise_server_exceptions = False
    dataset = upload(client, tsv_bytes(sentiment_rows()), name="typed").json()["id"]
    valid = {("POST", "/jobs"): job_body(dataset), ("POST", "/generate"): {"model": "tiny", "prompt": "hi"},
             ("POST", "/v1/completions"): {"model": "tiny", "prompt": "hi"},
             ("POST", "/webhooks"): {"url": "https://example.com/hook", "event_types": ["job.succeeded"]}}
    headers_of = _header_params(app)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    for route, fields in _body_fields(app).items():
        for field in fields:
            for value in WRONG_TYPES:
                body = {**valid.get(route, {}), field: value}
                response = client.request(route[0], route[1].replace("{", "").replace("}", ""), json=body,
                                          headers={"Authorization": f"Bearer {key}"})
                assert response.status_code < 500, (route, field, value, response.text[:300])
                if response.status_code >= 400:
                    assert response.json()["error"]["message"], (route, field, value)
    for operation in [result.ok() for result in schema.get_all_operations()]:
        names = headers_of.get((operation.method.upper(), operation.path), [])
        if names:
            _header_fuzzer(operation, names, client, key)()


def _header_fuzzer(operation, names: list[str], client, key: str):
    @given(case=operation.as_strategy(), value=DIGIT_HEADER)
    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case, value):
        # As a client's raw bytes: '²' is one byte in Latin-1, the encoding servers decode header values with.
        raw = value.encode("latin-1") if all(ord(c) < 256 for c in value) else value.encode()
        headers = {"Authorization": f"Bearer {key}", **{name: raw for name in names}}
        query = {**(case.query or {}), "stream": "true"} if operation.method.upper() == "GET" else case.query
        response = client.request(case.method, case.formatted_path, params=query, json=case.body
                                  if case.media_type == "application/json" else None, headers=headers)
        assert response.status_code < 500, (case.method, case.formatted_path, value, response.text[:300])

    return run
