"""POST /jobs with adapters and methods: the data must suit the method, DPO needs an adapter and a base model, the
base model must have a chat template for chat data, and base_model names finished jobs and <home>/models folders."""

from __future__ import annotations

import shutil

import pytest

from core.db import make_engine, make_sessionmaker, session_scope
from core.rows import Job, JobStatus
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload
from tests.tiny_chat import build_tiny_llama, chat_jsonl, drop_chat_template, preference_jsonl

ADAPTER = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture()
def chat_id(client):
    response = upload(client, chat_jsonl("Blue."), filename="chat.jsonl")
    assert response.json()["format"] == "chat", response.text
    return response.json()["id"]


@pytest.fixture()
def preference_id(client):
    response = upload(client, preference_jsonl("Blue.", "Red."), filename="prefs.jsonl")
    assert response.json()["format"] == "preference", response.text
    return response.json()["id"]


def _lm(dataset: str, base: str | None, **more):
    return {"task": "causal-lm", "train_dataset": dataset, "base_model": base,
            "hyperparameters": {"max_steps": 2, "batch_size": 2}, **more}


def _error(response, field):
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field, response.json()
    return response.json()["error"]["message"]


def test_a_lora_sft_job_on_chat_data_is_stored_with_its_adapter_and_method(client, chat_id, tiny_llama_dir):
    response = client.post("/jobs", json=_lm(chat_id, str(tiny_llama_dir), adapter=ADAPTER))
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["adapter"] == {"method": "lora", "r": 4, "alpha": 8.0, "dropout": 0.05,
                              "target_modules": ["q_proj", "v_proj"], "merge": False, "quantize_base": None}
    assert job["method"] == {"method": "sft"}
    rerun = client.post(f"/jobs/{job['id']}/rerun")
    assert rerun.status_code == 201, rerun.text
    assert rerun.json()["adapter"] == job["adapter"] and rerun.json()["method"] == job["method"]


def test_a_dpo_job_needs_preference_data_an_adapter_and_a_base(client, chat_id, preference_id, tiny_llama_dir):
    dpo = {"method": "dpo", "beta": 0.2}
    base = str(tiny_llama_dir)
    assert "preference dataset" in _error(client.post("/jobs", json=_lm(chat_id, base, adapter=ADAPTER, method=dpo)),
                                          "train_dataset")
    assert "adapter" in _error(client.post("/jobs", json=_lm(preference_id, base, method=dpo)), "adapter")
    assert "base_model" in _error(client.post("/jobs", json=_lm(preference_id, None, adapter=ADAPTER, method=dpo,
                                                                model_config={"n_layer": 1, "n_embd": 32,
                                                                              "n_head": 2, "n_positions": 64})),
                                  "adapter")
    assert "dpo" in _error(client.post("/jobs", json=_lm(preference_id, base, adapter=ADAPTER)), "train_dataset")
    response = client.post("/jobs", json=_lm(preference_id, base, adapter=ADAPTER, method=dpo))
    assert response.status_code == 201, response.text
    assert response.json()["method"] == dpo
    bad_beta = client.post("/jobs", json=_lm(preference_id, base, adapter=ADAPTER, method={"method": "dpo",
                                                                                             "beta": 0}))
    assert bad_beta.status_code == 422 and bad_beta.json()["error"]["field"] == "method.dpo.beta"


def test_chat_data_needs_a_base_with_a_chat_template(client, chat_id, tmp_path_factory):
    bare = drop_chat_template(build_tiny_llama(tmp_path_factory.mktemp("bare") / "llama"))
    assert "chat template" in _error(client.post("/jobs", json=_lm(chat_id, str(bare), adapter=ADAPTER)),
                                     "base_model")
    assert "base_model" in _error(client.post("/jobs", json=_lm(chat_id, None, model_config={
        "n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64})), "base_model")


def test_chat_data_does_not_train_a_classifier_and_tables_skip_no_column_check(client, chat_id, tiny_llama_dir):
    body = job_body(chat_id, adapter=ADAPTER)
    assert "causal-lm" in _error(client.post("/jobs", json=body), "train_dataset")
    table = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    assert _error(client.post("/jobs", json=_lm(table, str(tiny_llama_dir), text_column="nope")), "text_column")
    response = client.post("/jobs", json=job_body(table, adapter={"r": 2, "target_modules": ["query", "value"]}))
    assert response.status_code == 201, response.text
    assert response.json()["adapter"]["r"] == 2


def test_the_spec_refuses_bad_adapters_and_openapi_shows_them(client, chat_id, tiny_llama_dir):
    bad = client.post("/jobs", json=_lm(chat_id, str(tiny_llama_dir), adapter={"r": 0}))
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "adapter.r"
    bad = client.post("/jobs", json=_lm(chat_id, str(tiny_llama_dir), adapter={"target_modules": ["q proj"]}))
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "adapter.target_modules"
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert "adapter" in schemas["CausalLMJob"]["properties"] and "method" in schemas["CausalLMJob"]["properties"]
    assert "adapter" in schemas["ClassificationJob"]["properties"]
    assert "beta" in schemas["PreferenceConfig"]["properties"]


def test_base_model_names_a_finished_job_or_a_folder_under_home_models(client, settings, chat_id, tiny_llama_dir):
    first = client.post("/jobs", json=_lm(chat_id, str(tiny_llama_dir), adapter=ADAPTER)).json()["id"]
    assert "succeeded" in _error(client.post("/jobs", json=_lm(chat_id, first, adapter=ADAPTER)), "base_model")
    engine = make_engine(settings.resolved_database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        session.get(Job, first).status = JobStatus.SUCCEEDED
    engine.dispose()
    response = client.post("/jobs", json=_lm(chat_id, first, adapter=ADAPTER))
    assert response.status_code == 201, response.text
    assert response.json()["base_model"] == first
    missing = first[:-1] + ("1" if first[-1] == "0" else "0")
    assert "does not exist" in _error(client.post("/jobs", json=_lm(chat_id, missing)), "base_model")
    shutil.copytree(tiny_llama_dir, settings.home / "models" / "house-llama")
    response = client.post("/jobs", json=_lm(chat_id, "house-llama", adapter=ADAPTER))
    assert response.status_code == 201, response.text
    classifier = job_body(upload(client, tsv_bytes(sentiment_rows())).json()["id"], base_model=first)
    assert "causal-lm" in _error(client.post("/jobs", json=classifier), "base_model")


def test_a_qlora_job_is_stored_and_a_4bit_base_is_refused_where_it_cannot_run(client, chat_id, tiny_llama_dir):
    qlora = {**ADAPTER, "quantize_base": "nf4"}
    response = client.post("/jobs", json=_lm(chat_id, str(tiny_llama_dir), adapter=qlora))
    assert response.status_code == 201, response.text
    assert response.json()["adapter"]["quantize_base"] == "nf4"
    int4 = _lm(chat_id, str(tiny_llama_dir), adapter={**qlora, "quantize_base": "int4"})
    assert _error(client.post("/jobs", json=int4), "adapter.quantize_base")
    fsdp = _lm(chat_id, str(tiny_llama_dir), adapter=qlora, devices=2,
               hyperparameters={"max_steps": 2, "batch_size": 2, "sharding": "fsdp"})
    assert "sharded" in _error(client.post("/jobs", json=fsdp), "adapter.quantize_base")
    table = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    classifier = job_body(table, adapter={"r": 2, "target_modules": ["query", "value"], "quantize_base": "nf4"})
    assert "causal-lm" in _error(client.post("/jobs", json=classifier), "adapter.quantize_base")
