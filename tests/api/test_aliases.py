"""Model aliases: served by every generation route (chat, completions, /generate, batches, embeddings), listed by
/v1/models with their targets, moved atomically with a recorded history and a webhook event, and moved only when
the gate's eval says the new target beats the current one."""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from sqlalchemy import select

from core.db import make_engine, make_sessionmaker, session_scope
from core.rows import WebhookEvent
from tests.api.test_batches import served  # noqa: F401 - "tiny", a chat model; batch tasks run in-process
from tests.api.test_upload_slots import running
from tests.conftest import make_key
from tests.tiny_lm import build_tiny_gpt2
from tests.webhook_receiver import Receiver

QUESTIONS = ["Name a colour", "Say hi", "Count to three"]
CHAT = [{"role": "user", "content": "Name a colour"}]


@pytest.fixture()
def api(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=client.headers["Authorization"].split()[1],
                         http_client=client, max_retries=0)


@pytest.fixture()
def other(settings, served):  # noqa: F811
    """A second chat model ("other"): a different tiny GPT-2 with the same chat template."""
    from transformers import AutoTokenizer

    path = build_tiny_gpt2(settings.home / "models" / "other", n_positions=64, seed=7)
    AutoTokenizer.from_pretrained(served).save_pretrained(path)
    return path


def _answer(api, model: str, content: str) -> str:
    reply = api.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                        max_tokens=6, temperature=0)
    return reply.choices[0].message.content


def test_every_generation_route_serves_an_alias_and_models_lists_it(api, client, served, worker_ctx,  # noqa: F811
                                                                     queue):
    from core.tasks import TASK_EMBED
    from worker.servers import embeddings as embedding

    queue.handlers[TASK_EMBED] = lambda payload: embedding.serve_embed(worker_ctx, payload)
    created = client.post("/aliases", json={"name": "bot:production", "target": "tiny"})
    assert created.status_code == 201, created.text
    assert created.json()["target"] == "tiny" and created.json()["lineage"] == {"model": "tiny"}
    assert _answer(api, "bot:production", "Name a colour") == _answer(api, "tiny", "Name a colour")
    completion = api.completions.create(model="bot:production", prompt="Hello", max_tokens=5, temperature=0)
    assert completion.model == "bot:production"
    assert completion.choices[0].text == api.completions.create(model="tiny", prompt="Hello", max_tokens=5,
                                                                temperature=0).choices[0].text
    generated = client.post("/generate", json={"model": "bot:production", "prompt": "Hello", "max_new_tokens": 5,
                                               "temperature": 0})
    assert generated.status_code == 200 and generated.json()["choices"][0]["text"] == completion.choices[0].text
    listed = {m.id: m for m in api.models.list()}
    assert listed["bot:production"].target == "tiny" and listed["tiny"].target is None
    unknown = client.post("/v1/chat/completions", json={"model": "bot:staging", "messages": CHAT})
    assert unknown.status_code == 404 and unknown.json()["error"]["field"] == "model"
    embed = client.post("/aliases", json={"name": "search:production", "target": "minilm-l6"})
    assert embed.status_code == 201, embed.text
    vectors = [api.embeddings.create(model=model, input="A cat sits.").data[0].embedding
               for model in ("search:production", "minilm-l6")]
    assert vectors[0] == vectors[1]
    for body, field in [({"name": "no-colon", "target": "tiny"}, "name"),
                        ({"name": "bot:production", "target": "tiny"}, "name"),
                        ({"name": "bot:staging", "target": "nope"}, "target"),
                        ({"name": "bot:staging", "target": "bot:production"}, "target")]:
        refused = client.post("/aliases", json=body)
        assert refused.status_code in (409, 422, 404) and refused.json()["error"]["field"] == field, refused.json()


def test_a_batch_line_naming_an_alias_runs_its_target(api, client, served):  # noqa: F811
    import json

    client.post("/aliases", json={"name": "bot:production", "target": "tiny"})
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "bot:production", "messages": CHAT, "max_tokens": 6, "temperature": 0}}
    upload = api.files.create(file=("b.jsonl", json.dumps(line).encode() + b"\n"), purpose="batch")
    batch = api.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while (batch := api.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    [output] = [json.loads(x) for x in api.files.content(batch.output_file_id).read().splitlines()]
    assert output["response"]["body"]["choices"][0]["message"]["content"] == _answer(api, "tiny", "Name a colour")


def _run(api, eval_id: str, model: str) -> str:
    run = api.evals.runs.create(eval_id, data_source={
        "type": "completions", "model": model, "sampling_params": {"max_completion_tokens": 6, "temperature": 0},
        "source": {"type": "file_content", "content": [{"item": {"q": q}} for q in QUESTIONS]},
        "input_messages": {"type": "template", "template": [{"role": "user", "content": "{{item.q}}"}]}})
    deadline = time.monotonic() + 60
    while api.evals.runs.retrieve(run.id, eval_id=eval_id).status != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return run.id


def test_a_gated_move_needs_a_better_run_and_every_move_is_recorded(api, client, settings, other):
    settings.webhook_allow_private = True  # the receiver listens on loopback
    receiver = Receiver().start()
    try:
        hook = client.post("/webhooks", json={"url": receiver.url, "event_types": ["model_alias.moved"]})
        assert hook.status_code == 201, hook.text
        # The eval rewards "other"'s own answers: other passes every item, tiny (almost surely) none.
        wanted = {q: _answer(api, "other", q) for q in QUESTIONS}
        assert wanted != {q: _answer(api, "tiny", q) for q in QUESTIONS}
        evaluation = api.evals.create(
            data_source_config={"type": "custom", "item_schema": {"type": "object"}},
            testing_criteria=[{"type": "multi", "name": "as other answers", "calculate_output": "a + b + c",
                               "graders": {name: {"type": "string_check", "name": name, "operation": "ilike",
                                                  "input": "{{item.q}}|{{sample.output_text}}",
                                                  "reference": f"{q}|{wanted[q]}"}
                                           for name, q in zip("abc", QUESTIONS, strict=True)},
                               "pass_threshold": 1}])
        assert client.post("/aliases", json={"name": "bot:production", "target": "tiny",
                                             "gate_eval_id": evaluation.id}).status_code == 201
        blocked = client.post("/aliases/bot:production/move", json={"target": "other"})
        assert blocked.status_code == 409 and "no completed run" in blocked.json()["error"]["message"]
        tiny_run, other_run = _run(api, evaluation.id, "tiny"), _run(api, evaluation.id, "other")
        stale = client.post("/aliases/bot:production/move", json={"target": "other", "expected_target": "other"})
        assert stale.status_code == 409 and stale.json()["error"]["field"] == "expected_target"
        moved = client.post("/aliases/bot:production/move", json={"target": "other", "run_id": other_run})
        assert moved.status_code == 200, moved.text
        assert moved.json()["target"] == "other"
        assert _answer(api, "bot:production", QUESTIONS[0]) == wanted[QUESTIONS[0]]
        back = client.post("/aliases/bot:production/move", json={"target": "tiny", "run_id": tiny_run})
        assert back.status_code == 409 and back.json()["error"]["details"]["passed"] is False
        assert client.get("/aliases/bot:production").json()["target"] == "other"  # a refused move moves nothing
        history = client.get("/aliases/bot:production/history").json()["data"]
        assert [(m["from_target"], m["to_target"]) for m in history] == [("tiny", "other"), (None, "tiny")]
        gate = history[0]["gate"]
        assert (gate["run_id"], gate["baseline_run_id"], gate["passed"]) == (other_run, tiny_run, True)
        assert gate["score"] == 1.0 > gate["baseline_score"] and history[0]["moved_by"].startswith("key_")
        engine = make_engine(settings.resolved_database_url)
        with session_scope(make_sessionmaker(engine)) as session:
            events = list(session.scalars(select(WebhookEvent).where(WebhookEvent.type == "model_alias.moved")))
        engine.dispose()
        assert len(events) == 2 and '"to":"other"' in events[-1].payload.replace(" ", "")
        assert client.delete("/aliases/bot:production").status_code == 204
        assert client.get("/aliases").json()["data"] == []
    finally:
        receiver.stop()


@pytest.fixture()
def local_model(settings):
    """<home>/models/tiny: a servable chat model (no worker needed to name it as a target)."""
    from tests.tiny_chat import build_tiny_llama

    return build_tiny_llama(settings.home / "models" / "tiny", seed=1)


def _at_once(calls) -> list[httpx.Response]:
    """Run the calls in threads released together: the race a second client (or a retry) makes."""
    barrier = threading.Barrier(len(calls))

    def one(call):
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(one, calls))


def test_racing_creates_and_deletes_of_one_alias_get_one_success_and_the_rest_a_4xx(settings, queue, local_model):
    key = make_key(settings.resolved_database_url, tenant="tenant-a")
    with running(settings, queue) as base:
        api = httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {key}"})
        for round_ in range(3):  # the race is lost or won at the insert: a few rounds make each order likely
            name = f"bot:race{round_}"
            created = _at_once([lambda n=name: api.post("/aliases", json={"name": n, "target": "tiny"})] * 4)
            assert sorted(r.status_code for r in created) == [201, 409, 409, 409], [r.text for r in created]
            assert all(r.json()["error"]["field"] == "name" for r in created if r.status_code == 409)
            assert [m["to_target"] for m in api.get(f"/aliases/{name}/history").json()["data"]] == ["tiny"]
            deleted = _at_once([lambda n=name: api.delete(f"/aliases/{n}")] * 4)
            assert sorted(r.status_code for r in deleted) == [204, 404, 404, 404], [r.text for r in deleted]
            assert api.get(f"/aliases/{name}").status_code == 404
        assert api.get("/aliases").json()["data"] == []


def test_an_alias_never_points_at_another_tenants_model(client, settings, local_model):
    from core.paths import job_model_dir
    from core.rows import Job, JobStatus
    from tests.factories import upload
    from tests.tiny_chat import chat_jsonl

    other = {"Authorization": f"Bearer {make_key(settings.resolved_database_url, tenant='tenant-b')}"}
    admin = {"Authorization": f"Bearer {make_key(settings.resolved_database_url, tenant='ops', admin=True)}"}
    client.headers.update(other)
    dataset = upload(client, chat_jsonl("Blue."), filename="chat.jsonl").json()["id"]
    submitted = client.post("/jobs", json={"task": "causal-lm", "base_model": "tiny", "train_dataset": dataset})
    assert submitted.status_code == 201, submitted.text
    job_id = submitted.json()["id"]
    shutil.copytree(local_model, job_model_dir(settings, job_id))
    engine = make_engine(settings.resolved_database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        session.get(Job, job_id).status = JobStatus.SUCCEEDED
    engine.dispose()
    assert client.post("/aliases", json={"name": "b:prod", "target": job_id}).status_code == 201  # b's own: served
    absent = "job_" + "0" * 24
    mine = {"Authorization": f"Bearer {make_key(settings.resolved_database_url, tenant='tenant-a')}"}
    client.headers.update(mine)
    assert client.post("/aliases", json={"name": "a:prod", "target": "tiny"}).status_code == 201
    for target in (job_id, absent):  # another tenant's model answers exactly as a model that does not exist
        created = client.post("/aliases", json={"name": "a:stage", "target": target})
        moved = client.post("/aliases/a:prod/move", json={"target": target})
        for refused in (created, moved):
            assert refused.status_code == 404 and refused.json()["error"]["field"] == "target", refused.text
    # An admin moving tenant-a's alias names a model in tenant-a's eyes: b's job is not one.
    client.headers.update(admin)
    moved = client.post("/aliases/a:prod/move", json={"target": job_id})
    assert moved.status_code == 404 and moved.json()["error"]["field"] == "target", moved.text
    created = client.post("/aliases", json={"name": "ops:prod", "target": job_id})
    assert created.status_code == 404 and created.json()["error"]["field"] == "target", created.text
    client.headers.update(mine)
    assert client.get("/aliases/a:prod").json()["target"] == "tiny"
