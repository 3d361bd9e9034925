"""The dashboard's eval and alias pages in headless Chromium, on the running service with the eval and alias
routes played by Playwright (page.route) in the shapes the API answers: an eval's runs with pass rates, one run's
items with every grade, two runs side by side (item by item), and an alias with its lineage and history."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.browser.conftest import columns_line_up

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CRITERIA = [{"type": "string_check", "name": "says blue"}, {"type": "text_similarity", "name": "close"}]
EVAL = {"object": "eval", "id": "eval_" + "1" * 24, "name": "sky", "created_at": 1, "metadata": None,
        "data_source_config": {"type": "custom", "schema": {}}, "testing_criteria": CRITERIA}


def _run(run_id: str, name: str, model: str, passed: int, role: str | None = None) -> dict[str, Any]:
    return {"object": "eval.run", "id": run_id, "eval_id": EVAL["id"], "name": name, "model": model,
            "status": "completed", "created_at": 1, "data_source": {}, "batch_id": "batch_" + "2" * 24,
            "job_id": "job_" + "3" * 24 if role else None, "role": role, "report_url": "", "error": None,
            "result_counts": {"total": 2, "passed": passed, "failed": 2 - passed, "errored": 0},
            "per_testing_criteria_results": [{"testing_criteria": "says blue", "passed": passed, "failed": 2 - passed},
                                             {"testing_criteria": "close", "passed": passed, "failed": 2 - passed}],
            "per_model_usage": [], "metadata": None}


BASE = _run("evalrun_" + "a" * 24, "base", "tiny", 0, "base")
TUNED = _run("evalrun_" + "b" * 24, "fine-tuned", "job_" + "3" * 24, 2, "fine_tuned")


def _items(run: dict[str, Any], answers: list[str], passed: bool) -> dict[str, Any]:
    data = [{"object": "eval.run.output_item", "id": f"outitem_{i:024d}", "run_id": run["id"], "eval_id": EVAL["id"],
             "created_at": 1, "status": "pass" if passed else "fail", "datasource_item_id": i,
             "datasource_item": {"question": f"q{i}", "answer": "Blue."},
             "sample": {"output": [{"role": "assistant", "content": answer}], "error": None},
             "results": [{"name": "says blue", "type": "string_check", "score": float(passed), "passed": passed},
                         {"name": "close", "type": "text_similarity", "score": 0.9 if passed else 0.1,
                          "passed": passed}]}
            for i, answer in enumerate(answers)]
    return {"object": "list", "data": data, "has_more": False, "first_id": data[0]["id"], "last_id": data[-1]["id"]}


ALIAS = {"object": "model_alias", "id": "alias_" + "4" * 24, "name": "bot:production", "target": TUNED["model"],
         "gate_eval_id": EVAL["id"], "description": None, "created_at": 1, "updated_at": 2,
         "lineage": {"base_model": "tiny", "dataset": {"id": "ds_" + "5" * 24, "name": "chat.jsonl", "sha256": ""},
                     "job": {"id": TUNED["model"]}, "checkpoints": [{"id": "art", "kind": "model", "step": 24}]}}
HISTORY = {"object": "list", "data": [
    {"object": "model_alias.move", "id": "move_2", "alias": "bot:production", "from_target": "tiny",
     "to_target": TUNED["model"], "moved_by": "key_1", "moved_at": 2,
     "gate": {"eval_id": EVAL["id"], "run_id": TUNED["id"], "score": 1.0, "baseline_run_id": BASE["id"],
              "baseline_score": 0.0, "passed": True}},
    {"object": "model_alias.move", "id": "move_1", "alias": "bot:production", "from_target": None,
     "to_target": "tiny", "moved_by": "key_1", "moved_at": 1, "gate": None}]}


def _play(page: Any) -> None:
    listing = lambda data: {"object": "list", "data": data, "has_more": False}  # noqa: E731
    answers = {
        "/v1/evals": listing([EVAL]), f"/v1/evals/{EVAL['id']}": EVAL,
        f"/v1/evals/{EVAL['id']}/runs": listing([TUNED, BASE]),
        f"/v1/evals/{EVAL['id']}/runs/{BASE['id']}": BASE, f"/v1/evals/{EVAL['id']}/runs/{TUNED['id']}": TUNED,
        f"/v1/evals/{EVAL['id']}/runs/{BASE['id']}/output_items": _items(BASE, ["Red.", "Hello"], False),
        f"/v1/evals/{EVAL['id']}/runs/{TUNED['id']}/output_items": _items(TUNED, ["Blue.", "Blue."], True),
        "/aliases": {"object": "list", "data": [ALIAS]}, "/aliases/bot%3Aproduction/history": HISTORY,
    }

    def answer(route: Any) -> None:
        path = route.request.url.split("://", 1)[1].split("/", 1)[1].split("?")[0]
        body = answers.get("/" + path)
        if body is None:
            route.continue_()
        else:
            route.fulfill(status=200, content_type="application/json", body=json.dumps(body))

    page.route("**/v1/evals**", answer)
    page.route("**/aliases**", answer)


def test_eval_runs_one_runs_items_two_runs_side_by_side_and_aliases(page):
    _play(page)
    page.goto(page.url.split("#")[0] + "#/evals")
    page.wait_for_selector(f"[data-run='{TUNED['id']}']")
    rows = page.locator(f"[data-eval='{EVAL['id']}'] tbody tr")
    assert rows.count() == 2 and "100% (2/2)" in rows.nth(0).inner_text() and "0% (0/2)" in rows.nth(1).inner_text()
    assert "fine_tuned of job_" in rows.nth(0).inner_text()
    page.check(f"input[value='{BASE['id']}']")
    page.check(f"input[value='{TUNED['id']}']")
    page.click(f"[data-eval='{EVAL['id']}'] button[type=submit]")
    page.wait_for_selector("#run-pair tbody tr")
    pair = page.locator("#run-pair tbody tr")
    assert pair.count() == 2 and "Blue." in pair.nth(0).inner_text() and "Red." in pair.nth(0).inner_text()
    assert columns_line_up(page, "#run-pair table") == 2
    assert page.locator("#run-pair td.pass").count() == 4 and page.locator("#run-pair td.fail").count() == 4
    page.goto(page.url.split("#")[0] + f"#/evals/{EVAL['id']}/runs/{TUNED['id']}")
    page.wait_for_selector("#run-items tbody tr")
    assert columns_line_up(page, "#run-items table") == 2
    assert "q1" in page.locator("#run-items tbody tr").nth(1).inner_text()
    page.goto(page.url.split("#")[0] + "#/aliases")
    page.wait_for_selector("[data-alias='bot:production']")
    card = page.locator("[data-alias='bot:production']").inner_text()
    assert f"bot:production → {TUNED['model']}" in card and "dataset chat.jsonl" in card
    assert "100% vs 0%" in card and page.locator("[data-alias='bot:production'] tbody tr").count() == 2
