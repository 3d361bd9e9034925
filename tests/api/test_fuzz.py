"""Property-based fuzzing of the OpenAPI document (schemathesis): no 5xx, responses match the schema."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import make_key
from tests.factories import sentiment_rows, tsv_bytes, upload


@pytest.fixture()
def fuzz_target(client, settings):
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
