"""/v1/files and /v1/fine_tuning/jobs through the official openai client: the objects it parses, "auto"
hyperparameters, OpenAI's error shape with the field at fault, tenants, and after/limit pagination."""

from __future__ import annotations

import json

import openai
import pytest

from core.db import make_engine, make_sessionmaker, session_scope
from core.rows import Job, JobStatus, MetricPoint, utcnow
from tests.conftest import make_key
from tests.tiny_chat import chat_jsonl, preference_jsonl

BATCH = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}).encode() + b"\n"
                 for i in range(3))


def _api(client, key: str | None = None) -> openai.OpenAI:
    key = key or client.headers["Authorization"].split()[1]
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=0)


@pytest.fixture()
def api(client):
    return _api(client)


@pytest.fixture()
def chat_file(api):
    return api.files.create(file=("chat.jsonl", chat_jsonl("Blue.")), purpose="fine-tune")


def _create(api, chat_file, tiny_llama_dir, **more):
    return api.fine_tuning.jobs.create(model=str(tiny_llama_dir), training_file=chat_file.id, **more)


def _set(settings, job_id: str, **columns) -> None:
    engine = make_engine(settings.resolved_database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        job = session.get(Job, job_id)
        for name, value in columns.items():
            setattr(job, name, value)
    engine.dispose()


def test_files_upload_list_retrieve_content_and_delete(api, client, chat_file):
    assert chat_file.object == "file" and chat_file.purpose == "fine-tune" and chat_file.status == "processed"
    assert chat_file.bytes == len(chat_jsonl("Blue.")) and chat_file.filename == "chat.jsonl"
    assert api.files.retrieve(chat_file.id).id == chat_file.id
    assert api.files.content(chat_file.id).read() == chat_jsonl("Blue.")
    assert client.get(f"/datasets/{chat_file.id}").json()["format"] == "chat"  # the same dataset
    batch = api.files.create(file=("requests.jsonl", BATCH), purpose="batch")
    assert batch.purpose == "batch" and client.get(f"/datasets/{batch.id}").json()["rows"] == 3
    assert client.get(f"/datasets/{batch.id}/preview").json()["rows"][0]["custom_id"] == "r0"
    assert [f.id for f in api.files.list()] == [batch.id, chat_file.id]
    assert [f.id for f in api.files.list(purpose="batch")] == [batch.id]
    assert [f.id for f in api.files.list(order="asc")] == [chat_file.id, batch.id]
    deleted = api.files.delete(batch.id)
    assert deleted.deleted is True and deleted.id == batch.id
    with pytest.raises(openai.NotFoundError):
        api.files.retrieve(batch.id)


def test_a_file_upload_gets_the_upload_limit_not_the_json_one(api, settings):
    settings.max_request_bytes = 1024
    content = chat_jsonl("Blue.", repeat=20)
    assert len(content) > 4 * settings.max_request_bytes
    assert api.files.create(file=("big.jsonl", content), purpose="fine-tune").bytes == len(content)
    settings.max_upload_bytes = 1024
    with pytest.raises(openai.APIStatusError) as bad:
        api.files.create(file=("big.jsonl", content), purpose="fine-tune")
    assert bad.value.status_code == 413


def test_file_validation_names_the_field_and_the_line(api):
    with pytest.raises(openai.UnprocessableEntityError) as bad:
        api.files.create(file=("chat.jsonl", chat_jsonl("Blue.")), purpose="assistants")
    assert bad.value.body["param"] == "purpose" and bad.value.body["type"] == "invalid_request_error"
    broken = chat_jsonl("Blue.").split(b"\n")
    broken[2] = b'{"messages": [{"role": "robot", "content": "x"}]}'
    with pytest.raises(openai.UnprocessableEntityError) as bad:
        api.files.create(file=("chat.jsonl", b"\n".join(broken)), purpose="fine-tune")
    assert bad.value.body["param"] == "file" and bad.value.body["message"].startswith("line 3: messages[0].role")
    lines = BATCH.split(b"\n")
    lines[1] = lines[0]  # a repeated custom_id
    with pytest.raises(openai.UnprocessableEntityError) as bad:
        api.files.create(file=("requests.jsonl", b"\n".join(lines)), purpose="batch")
    assert bad.value.body["message"].startswith("line 2: custom_id 'r0' is used by an earlier line")
    with pytest.raises(openai.UnprocessableEntityError) as bad:
        api.files.create(file=("requests.jsonl", chat_jsonl("Blue.")), purpose="batch")
    assert bad.value.body["message"].startswith("line 1: unknown field 'messages'")


def test_unknown_ids_are_404_in_openais_error_shape(client):
    for path in ("/v1/files/ds_0000000000000000", "/v1/files/nope/content", "/v1/fine_tuning/jobs/job_00000000",
                 "/v1/fine_tuning/jobs/job_00000000/events", "/v1/fine_tuning/jobs/job_00000000/checkpoints"):
        response = client.get(path)
        assert response.status_code == 404, (path, response.text)
        error = response.json()["error"]
        assert error["code"] == "not_found" and error["type"] == "invalid_request_error", error
        assert {"message", "param"} <= set(error), error
    assert "type" not in client.get("/datasets/ds_0000000000000000").json()["error"]  # /v1 only


def test_another_tenants_files_and_jobs_are_invisible(api, client, settings, chat_file, tiny_llama_dir):
    job = _create(api, chat_file, tiny_llama_dir)
    other = _api(client, make_key(settings.resolved_database_url, tenant="tenant-b"))
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(chat_file.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(chat_file.id)
    with pytest.raises(openai.NotFoundError):
        other.fine_tuning.jobs.retrieve(job.id)
    assert list(other.files.list()) == [] and list(other.fine_tuning.jobs.list()) == []
    with pytest.raises(openai.UnprocessableEntityError) as bad:
        other.fine_tuning.jobs.create(model=str(tiny_llama_dir), training_file=chat_file.id)
    assert bad.value.body["param"] == "training_file"


def test_auto_hyperparameters_take_trainserves_defaults_and_values_map_onto_the_job(api, client, chat_file,
                                                                                   tiny_llama_dir):
    auto = _create(api, chat_file, tiny_llama_dir, method={"type": "supervised", "supervised": {
        "hyperparameters": {"n_epochs": "auto", "batch_size": "auto", "learning_rate_multiplier": "auto"}}})
    assert auto.object == "fine_tuning.job" and auto.status == "queued" and auto.fine_tuned_model is None
    assert auto.hyperparameters.n_epochs == 1 and auto.hyperparameters.batch_size == 8
    assert auto.hyperparameters.learning_rate_multiplier == 1.0 and auto.seed == 42
    assert auto.training_file == chat_file.id and auto.method.type == "supervised"
    same = client.get(f"/jobs/{auto.id}").json()  # the same job under /jobs
    assert same["hyperparameters"]["learning_rate"] == 3e-4 and same["method"] == {"method": "sft"}
    set_ = _create(api, chat_file, tiny_llama_dir, suffix="blue-v1", seed=7, metadata={"team": "a"},
                   validation_file=chat_file.id, hyperparameters={"n_epochs": 3, "batch_size": 2,
                                                                  "learning_rate_multiplier": 2},
                   extra_body={"adapter": {"r": 4}})
    assert set_.user_provided_suffix == "blue-v1" and set_.seed == 7 and set_.metadata == {"team": "a"}
    assert set_.hyperparameters.learning_rate_multiplier == 2.0 and set_.validation_file == chat_file.id
    job = client.get(f"/jobs/{set_.id}").json()
    assert job["hyperparameters"]["epochs"] == 3 and job["hyperparameters"]["batch_size"] == 2
    assert job["hyperparameters"]["learning_rate"] == pytest.approx(6e-4) and job["adapter"]["r"] == 4
    prefs = api.files.create(file=("prefs.jsonl", preference_jsonl("Blue.", "Red.")), purpose="fine-tune")
    dpo = _create(api, prefs, tiny_llama_dir, method={"type": "dpo", "dpo": {"hyperparameters": {
        "beta": 0.5, "max_steps": 4}}})
    assert dpo.method.type == "dpo" and dpo.method.dpo.hyperparameters.beta == 0.5
    job = client.get(f"/jobs/{dpo.id}").json()
    assert job["method"] == {"method": "dpo", "beta": 0.5} and job["adapter"]["method"] == "lora"
    assert job["hyperparameters"]["max_steps"] == 4  # a trainserve hyperparameter by its own name


@pytest.mark.parametrize(("body", "param"), [
    ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs"),
    ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"learning_rate_multiplier": 5000}}}},
     "method.supervised.hyperparameters.learning_rate_multiplier"),
    ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"block_size": 0}}}},
     "method.supervised.hyperparameters.block_size"),
    ({"method": {"type": "reinforcement"}}, "method.reinforcement"),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0}}}}, "method.dpo.hyperparameters.beta"),
    ({"method": {"type": "dpo"}}, "training_file"),  # a chat file, not preference pairs
    ({"validation_file": "ds_0000000000000000"}, "validation_file"),
    ({"integrations": [{"type": "wandb", "wandb": {"project": "p"}}]}, "integrations"),
    ({"suffix": "no spaces"}, "suffix"),
    ({"model": "no-such-model"}, "model"),
])
def test_fine_tuning_errors_name_openais_field(client, chat_file, tiny_llama_dir, body, param):
    response = client.post("/v1/fine_tuning/jobs", json={"model": str(tiny_llama_dir),
                                                         "training_file": chat_file.id, **body})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_pagination_after_and_limit(api, client, chat_file, tiny_llama_dir):
    ids = [_create(api, chat_file, tiny_llama_dir).id for _ in range(3)][::-1]  # newest first
    first = api.fine_tuning.jobs.list(limit=2)
    assert [j.id for j in first.data] == ids[:2] and first.has_more
    rest = api.fine_tuning.jobs.list(limit=2, after=ids[1])
    assert [j.id for j in rest.data] == ids[2:] and not rest.has_more
    assert [j.id for j in api.fine_tuning.jobs.list(limit=1)] == ids  # the client follows has_more
    files = [chat_file.id] + [api.files.create(file=(f"c{i}.jsonl", chat_jsonl("Blue.")), purpose="fine-tune").id
                              for i in range(2)]
    assert [f.id for f in api.files.list(limit=1)] == files[::-1]
    assert [f.id for f in api.files.list(limit=5, after=files[2]).data] == files[1::-1]
    assert client.get("/v1/fine_tuning/jobs", params={"limit": 0}).json()["error"]["param"] == "limit"
    assert client.get("/v1/fine_tuning/jobs", params={"after": "job_00000000"}).status_code == 404


def test_status_events_checkpoints_and_cancel(api, settings, chat_file, tiny_llama_dir):
    job = _create(api, chat_file, tiny_llama_dir)
    events = api.fine_tuning.jobs.list_events(job.id)
    assert events.data and events.data[0].object == "fine_tuning.job.event" and events.data[0].level == "info"
    cancelled = api.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    listed = list(api.fine_tuning.jobs.list_events(job.id, limit=1))  # newest first, one page at a time
    assert len(listed) >= 2 and [int(e.id.split("-")[1]) for e in listed] == sorted(
        (int(e.id.split("-")[1]) for e in listed), reverse=True)
    with pytest.raises(openai.ConflictError):
        api.fine_tuning.jobs.cancel(job.id)

    done = _create(api, chat_file, tiny_llama_dir)
    engine = make_engine(settings.resolved_database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        for step, loss in ((2, 1.5), (4, 1.2)):
            session.add(MetricPoint(job_id=done.id, step=step, epoch=step / 4, name="eval_loss", value=loss,
                                    created_at=utcnow()))
    engine.dispose()
    _set(settings, done.id, status=JobStatus.RUNNING, eta_seconds=60.0, heartbeat_at=utcnow())
    assert api.fine_tuning.jobs.retrieve(done.id).estimated_finish > job.created_at
    _set(settings, done.id, status=JobStatus.SUCCEEDED, finished_at=utcnow(), best={"step": 4, "metric": "eval_loss",
                                                                                    "value": 1.2},
         metrics={"train_tokens_per_second": 100.0, "train_runtime": 2.5})
    finished = api.fine_tuning.jobs.retrieve(done.id)
    assert finished.fine_tuned_model == done.id and finished.trained_tokens == 250
    checkpoints = api.fine_tuning.jobs.checkpoints.list(done.id)
    assert [c.step_number for c in checkpoints.data] == [4, 2]
    assert checkpoints.data[0].fine_tuned_model_checkpoint == done.id  # the best step is the served model
    assert checkpoints.data[0].metrics.valid_loss == 1.2 and checkpoints.data[1].metrics.step == 2
    after = api.fine_tuning.jobs.checkpoints.list(done.id, after=checkpoints.data[0].id)
    assert [c.step_number for c in after.data] == [2]
    _set(settings, done.id, status=JobStatus.FAILED, error={"code": "oom", "message": "out of memory",
                                                             "field": None})
    failed = api.fine_tuning.jobs.retrieve(done.id)
    assert failed.status == "failed" and failed.error.code == "oom" and failed.fine_tuned_model is None


def test_an_idempotency_key_returns_the_first_file_and_job(client, chat_file, tiny_llama_dir):
    headers = {"Idempotency-Key": "ft-1"}
    files = [client.post("/v1/files", files={"file": ("c.jsonl", chat_jsonl("Blue."))}, data={"purpose": "fine-tune"},
                         headers=headers).json()["id"] for _ in range(2)]
    assert files[0] == files[1]
    body = {"model": str(tiny_llama_dir), "training_file": chat_file.id, "suffix": "a"}
    jobs = [client.post("/v1/fine_tuning/jobs", json=body, headers=headers).json()["id"] for _ in range(2)]
    assert jobs[0] == jobs[1]
    reused = client.post("/v1/fine_tuning/jobs", json={**body, "suffix": "b"}, headers=headers)
    assert reused.status_code == 409 and reused.json()["error"]["code"] == "idempotency_key_reused"
