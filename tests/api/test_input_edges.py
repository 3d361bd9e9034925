"""Inputs that once gave 500s or resets answer 4xx, and every response carries the security headers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.security_headers import CSP

BAD_STOPS = [5, True, 1.5, [1], [None], ["a", 2], {"a": "b"}, ["a"] * 5, [""], ["x" * 101]]


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
@pytest.mark.parametrize("stop", BAD_STOPS)
def test_stop_is_a_string_or_a_list_of_up_to_4_strings(client, route, stop):
    response = client.post(route, json={"model": "tiny", "prompt": "hi", "stop": stop})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"].startswith("stop"), response.json()


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
@pytest.mark.parametrize("stop", ["\n", ["\n"], ["a", "b", "c", "d"], None])
def test_good_stops_pass_validation(client, route, stop):
    response = client.post(route, json={"model": "tiny", "prompt": "hi", "stop": stop})
    assert response.status_code == 404 and response.json()["error"]["field"] == "model"  # no such model here


def _assert_secure(response) -> None:
    headers = response.headers
    assert headers["content-security-policy"] == CSP
    assert "frame-ancestors 'none'" in CSP and "'unsafe-inline'" not in CSP and "script-src 'self'" in CSP
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["x-frame-options"] == "DENY"
    assert headers["referrer-policy"] == "no-referrer"


def test_security_headers_on_every_kind_of_response(client, settings):
    _assert_secure(client.get("/"))  # the dashboard page
    _assert_secure(client.get("/ui/js/main.js"))
    _assert_secure(client.get("/health"))
    _assert_secure(client.get("/jobs"))
    _assert_secure(client.get("/jobs", headers={"Authorization": "Bearer nope"}))  # 401
    _assert_secure(client.get("/no/such/route"))  # 404
    _assert_secure(client.post("/jobs", content=b"x" * (settings.max_request_bytes + 1)))  # 413 from the middleware
    docs = client.get("/docs")
    assert "frame-ancestors 'none'" in docs.headers["content-security-policy"]
    assert docs.headers["x-frame-options"] == "DENY"


def test_the_dashboard_has_no_inline_script_handlers_or_styles():
    """The CSP refuses inline script and style attributes: the page and its modules must not need them."""
    dashboard = Path(__file__).resolve().parents[2] / "app" / "dashboard"
    page = (dashboard / "index.html").read_text()
    assert all(re.search(r'\bsrc="/ui/', tag) for tag in re.findall(r"<script[^>]*>", page))
    assert not re.search(r"<script[^>]*>\s*[^<\s]", page) and not re.search(r"\son[a-z]+\s*=", page)
    assert "style=" not in page and "<style" not in page
    for module in (dashboard / "js").glob("*.js"):
        source = module.read_text()
        assert "innerHTML" not in source and "eval(" not in source and "new Function" not in source, module
        assert 'setAttribute("style"' not in source, module
