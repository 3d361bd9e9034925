"""API keys are refused in query strings and never reach the access log."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import httpx
import pytest

from app.access_log import RedactQueryCredentials
from core.auth import KEY_PREFIX, redact_query
from tests.integration.test_local_mode import _free_port, wait_healthy

FAKE_KEY = KEY_PREFIX + "A" * 20 + "_-b" * 8  # the shape of a real key (43 URL-safe characters after the prefix)


@pytest.mark.parametrize("param", ["api_key", "key", "access_token", "token", "API_KEY"])
def test_credential_named_query_parameters_are_refused(client, param):
    response = client.get("/jobs", params={param: "anything"})
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["code"] == "key_in_query" and error["field"] == param
    assert "Authorization" in error["message"]


def test_a_key_under_any_name_is_refused_even_with_a_valid_header(client):
    response = client.get("/datasets", params={"cursor": FAKE_KEY})
    assert response.status_code == 401 and response.json()["error"]["field"] == "cursor"
    response = client.get("/v1/models", params={"q": f"Bearer {FAKE_KEY}"})
    assert response.status_code == 401 and response.json()["error"]["field"] == "q"
    assert client.get("/datasets", params={"limit": 5}).status_code == 200  # ordinary parameters still work


def test_redact_query_keeps_ordinary_parameters():
    assert redact_query("/jobs?limit=5") == "/jobs?limit=5"
    assert redact_query("/jobs") == "/jobs"
    redacted = redact_query(f"/jobs?limit=5&api_key={FAKE_KEY}&x=Bearer%20{FAKE_KEY}")
    assert FAKE_KEY not in redacted and "limit=5" in redacted and redacted.count("REDACTED") == 2
    assert FAKE_KEY not in redact_query(f"/jobs?{FAKE_KEY}")
    assert FAKE_KEY not in redact_query(f"/jobs?token=abc&{FAKE_KEY}=1")
    assert redact_query(f"/jobs/{FAKE_KEY}/events?after=1") == "/jobs/REDACTED/events?after=1"


def test_filter_rewrites_uvicorn_access_records():
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5000", "GET", f"/jobs?key={FAKE_KEY}", "1.1", 401), None)
    assert RedactQueryCredentials().filter(record)
    assert FAKE_KEY not in record.getMessage() and "/jobs?key=REDACTED" in record.getMessage()


@pytest.mark.slow
def test_real_uvicorn_access_log_never_prints_a_key(settings, tmp_path):
    """`trainserve api` (real uvicorn, its own logging config): the key sent in a URL is not in its output."""
    port = _free_port()
    env = dict(os.environ, TRAINSERVE_HOME=str(settings.home), TRAINSERVE_DATABASE_URL=settings.resolved_database_url,
               TRAINSERVE_REDIS_URL=settings.resolved_redis_url, PYTHONUNBUFFERED="1")
    log_path = tmp_path / "api.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "trainserve.cli", "api", "--port", str(port)], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, log_path, "trainserve api")
        assert httpx.get(f"{base}/jobs", params={"api_key": FAKE_KEY}).status_code == 401
        assert httpx.get(f"{base}/health", params={"token": FAKE_KEY}).status_code == 200  # public, still redacted
        assert httpx.get(f"{base}/jobs", params={"limit": 3, "cursor": FAKE_KEY}).status_code == 401
        assert httpx.get(f"{base}/jobs/{FAKE_KEY}").status_code == 401  # a key pasted into the path
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    text = log_path.read_text()
    assert "GET /jobs?api_key=REDACTED" in text and "GET /health?token=REDACTED" in text, text
    assert FAKE_KEY not in text
