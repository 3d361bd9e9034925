"""A running service (API process, training and generation worker processes) and headless Chromium on it.

Chromium is Debian's `chromium` package (the Makefile's setup installs it), driven by Playwright's Python
package; a missing browser fails these tests, it never skips them. A failed test leaves a full-page
screenshot in var/test-screenshots/.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import INTEGRATION_REDIS, ROOT, make_key
from tests.service import started_service

CHROMIUM = os.environ.get("TRAINSERVE_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS = ROOT / "var" / "test-screenshots"


@dataclass
class Service:
    base: str
    key: str
    home: Path
    api: httpx.Client
    tiny_bert: Path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture(scope="package")
def service(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The API and two workers as separate processes on PostgreSQL and Redis, with a tiny GPT-2 to serve;
    one for the browser test modules of this package (a start costs half a minute on a small machine), stopped
    before other packages' tests, whose workers share the Redis queues."""
    from tests.tiny_lm import build_tiny_gpt2
    from tests.tiny_models import build_tiny_bert

    root = tmp_path_factory.mktemp("browser")
    home = root / "home"
    build_tiny_gpt2(home / "models" / "tiny-gpt2")
    tiny_bert = build_tiny_bert(root / "models" / "bert")
    with started_service(pg_url, INTEGRATION_REDIS, home, root, TRAINSERVE_MODEL_ROOTS=str(root / "models"),
                         TRAINSERVE_CHECKPOINT_STEPS="20", TRAINSERVE_EVENT_STREAMS_PER_TENANT="3",
                         TRAINSERVE_EVENT_STREAM_POLL_S="0.5") as base:
        key = make_key(pg_url, name="browser")
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as api:
            yield Service(base=base, key=key, home=home, api=api, tiny_bert=tiny_bert)


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    """Headless Debian chromium; its absence is a failure with the fix in the message."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright package is missing: run `make setup` (it is in the dev extras)")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `apt-get install -y chromium` (make setup does it as root)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


def columns_line_up(page, table: str) -> int:
    """Each visible header cell sits over its column's cells (same left edge and width); returns the rows seen."""
    geometry = page.evaluate("""(selector) => {
      const table = document.querySelector(selector);
      const box = (el) => { const r = el.getBoundingClientRect(); return [r.left, r.width, r.top, r.bottom]; };
      const shown = (row) => [...row.children].filter((c) => c.getBoundingClientRect().width > 0).map(box);
      return { head: shown(table.tHead.rows[0]), rows: [...table.tBodies[0].rows].filter((r) => r.cells.length > 1)
        .map(shown), tbodies: table.querySelectorAll("tbody").length };
    }""", table)
    assert geometry["tbodies"] == 1, table
    head = geometry["head"]
    assert geometry["rows"], f"{table} has no rows"
    for row in geometry["rows"]:
        assert len(row) == len(head), (table, head, row)
        for (h_left, h_width, _, h_bottom), (c_left, c_width, c_top, _) in zip(head, row, strict=True):
            assert abs(h_left - c_left) < 1 and abs(h_width - c_width) < 1, (table, head, row)
            assert c_top >= h_bottom - 1, (table, head, row)  # under the header, not beside it
    return len(geometry["rows"])


@pytest.fixture()
def page(browser: Any, service: Service, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh tab signed in with the service's key; a failed test leaves a screenshot."""
    # bypass_csp: playwright's wait_for_function evaluates strings, which the strict CSP refuses; a test marked
    # enforce_csp keeps the policy in force (and waits with selectors only)
    enforce = request.node.get_closest_marker("enforce_csp") is not None
    context = browser.new_context(viewport={"width": 1280, "height": 900}, bypass_csp=not enforce)
    tab = context.new_page()
    tab.set_default_timeout(30_000)
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.goto(service.base + "/")
    tab.fill("#login-key", service.key)
    tab.click("#login-form button[type=submit]")
    tab.wait_for_selector("#login", state="hidden")
    yield tab
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{request.node.name}.png"
        tab.screenshot(path=str(path), full_page=True)
        print(f"screenshot of the failed test: {path}")
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"
