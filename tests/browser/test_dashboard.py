"""The dashboard in headless Chromium against real API and worker processes: a tiny fine-tune drawn live,
cancel, dataset upload and preview, compare, a streamed completion, chat refused for a model without a chat
template, a narrow screen (tables' header and cell columns line up there too), and stream slots freed when
clients disconnect. The jobs list, job page and compare screenshots in docs/ come from here
(TRAINSERVE_UPDATE_DOCS_SCREENSHOTS=1; otherwise they go to var/test-screenshots/)."""

from __future__ import annotations

import json
import os
from contextlib import ExitStack

import httpx
import pytest

from tests.browser.conftest import SCREENSHOTS, Service, columns_line_up
from tests.conftest import ROOT
from tests.factories import job_body, sentiment_rows, tsv_bytes
from tests.integration.conftest import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# Waits are long because a busy CI box can be slow; on a quiet 2-core machine each takes seconds.
# The docs site's screenshots are refreshed only on request, so that a test run leaves the checkout clean.
DOCS = ROOT / "docs" if os.environ.get("TRAINSERVE_UPDATE_DOCS_SCREENSHOTS") == "1" else SCREENSHOTS
# 36 steps of a 2-layer BERT on 48 rows: enough for the loss to visibly fall in the docs screenshot.
HYPER = {"epochs": 6, "batch_size": 8, "learning_rate": 5e-3, "warmup_ratio": 0.1, "max_length": 32, "eval_steps": 6}
state: dict[str, str] = {}


def _dataset(service: Service, name: str) -> str:
    response = service.api.post("/datasets", files={"file": ("train.tsv", tsv_bytes(sentiment_rows(4)))},
                                data={"name": name})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def _job(service: Service, train: str, adapter: dict | None = None, **hp: object) -> str:
    body = job_body(train, train, base_model=str(service.tiny_bert), hyperparameters={**HYPER, **hp})
    if adapter is not None:
        body["adapter"] = adapter
    response = service.api.post("/jobs", json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def _status(service: Service, job_id: str) -> str:
    return str(service.api.get(f"/jobs/{job_id}").json()["status"])


def _fill_hyperparameters(page, hyper: dict[str, object]) -> None:
    """A typed spec has one input per hyperparameter; a free-form one is a JSON box."""
    box = page.locator("#new-job textarea[name=hyperparameters]")
    if box.count():
        box.fill(json.dumps(hyper))
        return
    for name, value in hyper.items():
        page.fill(f'#new-job [name="hyperparameters.{name}"]', str(value))


def test_a_job_started_from_the_form_draws_its_curve_live_until_it_succeeds(page, service):
    train = _dataset(service, "sentiment")
    page.click("#new-job-toggle")
    page.wait_for_selector("#new-job[data-ready=true]")
    page.select_option("#new-job select[name=train_dataset]", train)
    page.select_option("#new-job select[name=eval_dataset]", train)
    page.fill("#new-job input[name=base_model]", str(service.tiny_bert))
    assert page.input_value("#new-job input[name=text_column]") == "sentence"  # from the dataset's columns
    _fill_hyperparameters(page, HYPER)
    page.click("#new-job button[type=submit]")
    page.wait_for_url("**/#/jobs/job_*")
    job_id = page.url.rsplit("/", 1)[1]
    assert service.api.get(f"/jobs/{job_id}").json()["adapter"] is None  # an untouched adapter box sends none
    state["first"] = job_id
    state["second"] = _job(service, train, epochs=2, learning_rate=3e-3)  # queued behind it, for compare
    # The loss chart fills from the stream while the job runs, then the badge turns to succeeded.
    page.wait_for_function("document.querySelector('[data-chart=Loss]')?.dataset.points > 0", timeout=300_000)
    page.wait_for_selector("#job-status [data-status=succeeded]", timeout=300_000)
    losses = service.api.get(f"/jobs/{job_id}/metrics", params={"name": ["train_loss", "eval_loss"]}).json()["data"]
    assert len(losses) > 20
    page.wait_for_function(f"document.querySelector('[data-chart=Loss]')?.dataset.points == {len(losses)}")
    assert page.locator("#events [data-kind=succeeded]").count() == 1
    assert page.locator("#settings").inner_text().count("learning_rate") == 1
    page.wait_for_selector("#artifacts button")  # the model, downloadable
    with page.expect_download() as download:
        page.click("#artifacts button")
    assert download.value.suggested_filename.endswith(".tar")
    page.wait_for_timeout(400)  # the last redraw is throttled
    rate = json.loads(page.get_attribute("[data-chart='Learning rate']", "data-y-ticks"))
    assert len(set(rate)) == len(rate) > 1, rate  # warmup from 0 to 5e-3: every tick its own label
    steps = json.loads(page.get_attribute("[data-chart='Learning rate']", "data-x-ticks"))
    assert steps and all(label.isdigit() for label in steps), steps
    DOCS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(DOCS / "dashboard-job.png"), full_page=True)
    page.goto(service.base + "/#/jobs?status=succeeded")
    page.wait_for_selector(f"tr[data-job={job_id}] [data-status=succeeded]")
    assert "accuracy" in page.locator(f"tr[data-job={job_id}]").inner_text()  # the best metric column
    assert columns_line_up(page, "#view table") >= 1
    assert page.locator("#new-job").is_hidden()  # until "New job" is clicked
    page.screenshot(path=str(DOCS / "dashboard-jobs.png"), full_page=True)


def test_cancel_from_the_job_page_of_a_lora_job(page, service):
    job_id = _job(service, _dataset(service, "long"), adapter={"r": 4, "alpha": 8}, epochs=100)
    page.goto(f"{service.base}/#/jobs/{job_id}")
    page.wait_for_selector("#settings")
    assert "+ LORA r4" in page.locator("#view").inner_text()  # the header names the adapter on its base
    settings = page.locator("#settings").inner_text()
    assert "adapter.r\t4" in settings and "adapter.alpha\t8" in settings and "adapter.target_modules" in settings
    page.click("#cancel")
    page.wait_for_selector("#job-status [data-status=cancelled]", timeout=60_000)
    assert _status(service, job_id) == "cancelled"


def test_upload_a_dataset_and_see_its_preview(page, service, tmp_path):
    path = tmp_path / "reviews.csv"
    path.write_text("review,stars\n" + "".join(f"review number {i},{i % 5 + 1}\n" for i in range(40)))
    page.goto(service.base + "/#/datasets")
    page.set_input_files("#upload input[type=file]", str(path))
    page.fill("#upload input[name=name]", "reviews")
    page.click("#upload button[type=submit]")
    page.wait_for_selector("#preview table")
    assert page.locator("#preview tbody tr").count() == 20
    assert columns_line_up(page, "#preview table") == 20
    assert columns_line_up(page, "#view > .card:last-child table") >= 2  # the list of datasets
    assert "review number 0" in page.locator("#preview").inner_text()
    summary = page.locator("#column-summary").inner_text()
    assert "stars" in summary and "5 distinct" in summary


def test_compare_two_jobs_shows_only_the_settings_that_differ(page, service):
    first, second = state["first"], state["second"]
    wait_for(lambda: _status(service, second) in ("succeeded", "failed"), 300, "the second job to finish")
    page.goto(f"{service.base}/#/compare?ids={first},{second}")
    page.wait_for_function("document.querySelector('[data-chart=train_loss]')?.dataset.points > 0")
    settings = [page.locator("[data-setting]").nth(i).get_attribute("data-setting")
                for i in range(page.locator("[data-setting]").count())]
    assert sorted(settings) == ["hyperparameters.epochs", "hyperparameters.learning_rate"]
    page.check("#show-all-settings")
    assert page.locator("[data-setting]").count() > 10
    page.uncheck("#show-all-settings")
    page.wait_for_timeout(400)
    page.screenshot(path=str(DOCS / "dashboard-compare.png"), full_page=True)


def test_playground_streams_a_completion(page, service):
    page.goto(service.base + "/#/playground")
    page.select_option("#model", "tiny-gpt2")
    page.fill("#playground input[name=max_new_tokens]", "24")
    page.click("#playground button[type=submit]")
    page.wait_for_selector("#playground[data-done=true]", timeout=120_000)
    assert len(page.locator("#completion").inner_text()) > len("ROMEO:")
    assert "24 tokens" in page.locator("#completion-stats").inner_text()


def test_chat_with_a_model_without_a_chat_template_falls_back_to_completion(page, service):
    # The tiny GPT-2 ships no chat template: the server refuses the chat (422 naming the model, or 404 where
    # there is no chat route) and the page goes back to completion mode with the reason, chat greyed out.
    page.goto(service.base + "/#/playground?mode=chat")
    page.select_option("#model", "tiny-gpt2")
    page.fill("#chat textarea[name=message]", "Hello there")
    page.click("#chat button[type=submit]")
    page.wait_for_selector("#completion-panel:not([hidden])", timeout=60_000)
    assert page.locator("#chat-panel").is_hidden()
    assert page.locator("[data-mode=chat]").is_disabled()
    assert "tiny-gpt2" in page.inner_text("#mode-note")
    assert page.input_value("#chat textarea[name=message]") == "Hello there"  # kept for another model


def test_narrow_screen_has_no_sideways_scroll(page, service):
    page.set_viewport_size({"width": 390, "height": 800})
    for view in ("#/jobs", f"#/jobs/{state['first']}", "#/datasets", "#/playground"):
        page.goto(service.base + "/" + view)
        page.wait_for_timeout(500)
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"), view
        if view in ("#/jobs", "#/datasets"):
            columns_line_up(page, "#view > .card:last-child table")  # hidden columns hide header and cells alike


def test_event_stream_slots_come_back_when_clients_disconnect(service):
    job_id = _job(service, _dataset(service, "slots"), epochs=100)  # queued: its stream stays open
    headers = {"Authorization": f"Bearer {service.key}"}
    url = f"{service.base}/jobs/{job_id}/events?stream=true"
    for _ in range(3):  # over the bound of 3 open streams, had the closed ones kept their slots
        with httpx.Client(timeout=10) as client, client.stream("GET", url, headers=headers) as response:
            assert response.status_code == 200
            next(response.iter_lines())
    with httpx.Client(timeout=10) as client, ExitStack() as open_streams:
        streams = [open_streams.enter_context(client.stream("GET", url, headers=headers)) for _ in range(3)]
        # Keep the line iterators: a dropped one closes its connection (and the server frees the slot).
        lines = [r.iter_lines() for r in streams]
        assert all(next(it) == "retry: 2000" for it in lines)  # each body has started and holds its slot
        with client.stream("GET", url, headers=headers) as refused:
            assert refused.status_code == 429
            assert json.loads(refused.read())["error"]["code"] == "too_many_streams"
        assert len(lines) == 3
    service.api.post(f"/jobs/{job_id}/cancel")
