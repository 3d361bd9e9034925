"""A caller whose requests keep being refused is answered 429 before its body is parsed or its key looked up: a
tenant sending 540 kB prompts past the context cost the API a parse each, at the rate it liked. Real uvicorn."""

from __future__ import annotations

import json

import httpx

from app.limits import RefusalBudget
from tests.api.test_upload_slots import running
from tests.conftest import make_key

HUGE = json.dumps({"model": "tiny-gpt2", "max_tokens": -4,  # refused: max_tokens must be at least 1
                   "messages": [{"role": "user", "content": "To be, or not to be. " * 25_000}]})  # 525 kB


def test_the_budget_is_a_token_bucket_per_caller():
    now = [0.0]
    budget = RefusalBudget(per_second=2.0, burst=3, clock=lambda: now[0])
    assert budget.wait_s("a") == 0
    for _ in range(3):
        budget.refused("a")
    assert budget.wait_s("a") == 0.5 and budget.wait_s("b") == 0  # a spent its burst; b has its own
    now[0] = 0.5
    assert budget.wait_s("a") == 0  # one refusal refilled
    budget.refused("a")
    assert budget.wait_s("a") == 0.5
    now[0] = 100.0
    budget.refused("a")
    assert budget.wait_s("a") == 0  # refilled to the burst, no more: two left after this one
    budget.refused("a")
    budget.refused("a")
    assert budget.wait_s("a") > 0


def test_a_caller_refused_past_its_burst_gets_429_before_its_body_is_read_and_others_do_not(settings, queue):
    settings.refusal_burst, settings.refusals_per_second = 3, 0.5
    hostile = make_key(settings.resolved_database_url, tenant="hostile")
    normal = make_key(settings.resolved_database_url, tenant="normal")
    with running(settings, queue) as base:
        bad = httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {hostile}",
                                                               "Content-Type": "application/json"})
        good = httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {normal}"})
        answers = [bad.post("/v1/chat/completions", content=HUGE) for _ in range(5)]
        assert [a.status_code for a in answers] == [422, 422, 422, 429, 429], [a.text for a in answers]
        refused = answers[-1]
        assert refused.json()["error"]["code"] == "too_many_refusals" and int(refused.headers["retry-after"]) >= 1
        # Past its budget even a request the route would answer is refused, and the client reads the 429 whole.
        assert bad.get("/datasets").status_code == 429
        assert good.get("/datasets").status_code == 200  # another caller has its own budget
        # Without a key, the budget is the client address's: 401s spend it.
        anonymous = httpx.Client(base_url=base, timeout=30)
        codes = [anonymous.get("/datasets").status_code for _ in range(4)]
        assert codes == [401, 401, 401, 429]


def test_made_up_keys_spend_their_address_budget_and_a_real_key_from_it_is_still_answered(settings, queue):
    settings.refusal_burst, settings.refusals_per_second = 3, 0.5
    real = make_key(settings.resolved_database_url, tenant="normal")
    with running(settings, queue) as base:
        client = httpx.Client(base_url=base, timeout=30)
        assert client.get("/datasets", headers={"Authorization": f"Bearer {real}"}).status_code == 200
        # A new invented key each time: each its own credential, all from one address.
        codes = [client.get("/datasets", headers={"Authorization": f"Bearer ts_made_up_{i}"}).status_code
                 for i in range(6)]
        assert codes == [401, 401, 401, 429, 429, 429], codes
        refused = client.get("/datasets", headers={"Authorization": "Bearer ts_made_up_next"})
        assert refused.json()["error"]["code"] == "too_many_refusals" and int(refused.headers["retry-after"]) >= 1
        assert client.get("/datasets").status_code == 429  # without a key: the same address's budget
        # The key this process has accepted is not the one refused: it is answered beside the spent address.
        assert client.get("/datasets", headers={"Authorization": f"Bearer {real}"}).status_code == 200
