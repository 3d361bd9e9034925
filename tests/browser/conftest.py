"""A running service (API process, training and generation worker processes) and headless Chromium on it.

Chromium is Debian's `chromium` package (the Makefile's setup installs it), driven by Playwright's Python
package; a missing browser fails these tests, it never skips them. A failed test leaves a full-page
screenshot in var/test-screenshots/.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_lib
from sqlalchemy import create_engine, text

from core.rows import Base
from tests.conftest import ROOT, make_key
from tests.integration.conftest import INTEGRATION_REDIS, _free_port, wait_for

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


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def service(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The API and two workers as separate processes on PostgreSQL and Redis, with a tiny GPT-2 to serve."""
    from tests.tiny_lm import build_tiny_gpt2
    from tests.tiny_models import build_tiny_bert

    client = redis_lib.Redis.from_url(INTEGRATION_REDIS)
    client.flushdb()  # an unreachable Redis fails the test: never a silent skip
    client.close()
    root = tmp_path_factory.mktemp("browser")
    home = root / "home"
    build_tiny_gpt2(home / "models" / "tiny-gpt2")
    tiny_bert = build_tiny_bert(root / "models" / "bert")
    port = _free_port()
    env = dict(os.environ, TRAINSERVE_HOME=str(home), TRAINSERVE_DATABASE_URL=pg_url,
               TRAINSERVE_REDIS_URL=INTEGRATION_REDIS, TRAINSERVE_MODEL_ROOTS=str(root / "models"),
               TRAINSERVE_CHECKPOINT_STEPS="20", TRAINSERVE_EVENT_STREAMS_PER_TENANT="3",
               TRAINSERVE_EVENT_STREAM_POLL_S="0.5", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen[bytes]] = []
    for name, args in (("api", ["api", "--port", str(port)]),
                       ("training", ["worker", "--device", "cpu", "--queues", "training"]),
                       ("generation", ["worker", "--device", "cpu", "--queues", "generation"])):
        log = open(root / f"{name}.log", "wb")  # noqa: SIM115
        procs.append(subprocess.Popen([sys.executable, "-m", "trainserve.cli", *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=ROOT))
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert procs[0].poll() is None, (root / "api.log").read_text()
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, 60, "the API process to answer /health")
        key = make_key(pg_url, name="browser")
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as api:
            yield Service(base=base, key=key, home=home, api=api, tiny_bert=tiny_bert)
    finally:
        _stop(procs)
        engine = create_engine(pg_url)
        with engine.begin() as conn:  # leave the shared test database empty for the tests after this module
            conn.execute(text(f"TRUNCATE {', '.join(t.name for t in Base.metadata.sorted_tables)} CASCADE"))
        engine.dispose()


@pytest.fixture(scope="module")
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


@pytest.fixture()
def page(browser: Any, service: Service, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh tab signed in with the service's key; a failed test leaves a screenshot."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
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
