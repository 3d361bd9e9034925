"""A finished LoRA adapter job's id is a model name on the generation routes: /v1/models lists it, and
/v1/completions and /v1/chat/completions naming it answer as HF + PEFT on its folder, in one burst that mixes two
adapters and their base (served by one engine: the base loads once); an adapter over a GPT-2 base (no batched LoRA
path) is served whole, the base with the adapter folded in, and answers as HF + PEFT too."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from transformers import AutoTokenizer

from core.adapters import AdapterConfig
from core.db import make_engine, make_sessionmaker, session_scope
from core.paths import MANIFEST_NAME, job_model_dir
from core.rows import Job, JobStatus
from tests.factories import upload
from tests.tiny_adapters import hf_greedy, make_adapters, peft_model
from tests.tiny_chat import build_tiny_llama, chat_jsonl

LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}


def _finish(settings, job_id: str, folder) -> None:
    """Mark the job succeeded with `folder` as its stored model (what a LoRA job's worker uploads)."""
    target = job_model_dir(settings, job_id)
    shutil.copytree(folder, target)
    (target / MANIFEST_NAME).write_text(json.dumps({"task": "causal-lm", "adapter": LORA}))
    engine = make_engine(settings.resolved_database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        session.get(Job, job_id).status = JobStatus.SUCCEEDED
    engine.dispose()


@pytest.fixture()
def served(client, settings, worker_ctx, tmp_path):
    """<home>/models/tiny (a chat Llama) and two adapter jobs over it: name -> (job id, adapter folder)."""
    base = build_tiny_llama(settings.home / "models" / "tiny", seed=1)
    folders = make_adapters(base, tmp_path)
    dataset = upload(client, chat_jsonl("Blue."), filename="chat.jsonl").json()["id"]
    jobs = {}
    for name, folder in folders.items():
        response = client.post("/jobs", json={"task": "causal-lm", "train_dataset": dataset, "base_model": "tiny",
                                              "adapter": LORA, "hyperparameters": {"max_steps": 2}})
        assert response.status_code == 201, response.text
        _finish(settings, response.json()["id"], folder)
        jobs[name] = response.json()["id"]
    return base, folders, jobs


def test_adapter_jobs_answer_as_peft_in_one_burst_with_their_base(client, served, worker_ctx):
    from worker.servers import generation as serving

    base, folders, jobs = served
    listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert set(jobs.values()) <= set(listed) and "tiny" in listed
    api = openai.OpenAI(base_url="http://testserver/v1", api_key=client.headers["Authorization"].split()[1],
                        http_client=client, max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    chats = [[{"role": "user", "content": "Hello there!"}], [{"role": "user", "content": "What is two plus two?"}]]
    prompts = ["The sky is", "Name a colour: red, green,"]
    asks = [(name, kind, index) for name in (None, "wide", "narrow") for kind in ("chat", "text") for index in (0, 1)]

    def ask(item):
        name, kind, index = item
        model = "tiny" if name is None else jobs[name]
        if kind == "chat":
            reply = api.chat.completions.create(model=model, messages=chats[index], max_tokens=8 + index,
                                                temperature=0)
            return reply.choices[0].message.content
        return api.completions.create(model=model, prompt=prompts[index], max_tokens=8 + index,
                                      temperature=0).choices[0].text

    with ThreadPoolExecutor(max_workers=len(asks)) as pool:  # one burst: base and both adapters, chats and text
        answers = list(pool.map(ask, asks))
    models = {name: peft_model(base, None if name is None else folders[name]) for name in (None, "wide", "narrow")}
    for (name, kind, index), answer in zip(asks, answers, strict=True):
        if kind == "chat":
            ids = list(tokenizer.apply_chat_template(chats[index], add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))
        else:
            ids = tokenizer(prompts[index])["input_ids"]
        want = tokenizer.decode(hf_greedy(models[name], ids, 8 + index), skip_special_tokens=True)
        assert answer == want, (name, kind, index)
    assert len({answers[0], answers[4], answers[8]}) == 3  # base and the two adapters answer differently
    registry = worker_ctx.service("generation", serving.GenerationService.build).registry
    assert len(registry.loaded()) == 1  # one engine: the base, with both adapters resident
    with registry.use(registry.loaded()[0]) as engine:
        assert sorted(engine.stats()["adapters"]) == sorted(jobs.values())


def test_an_adapter_over_a_gpt2_base_is_served_merged_and_answers_as_peft(client, settings, worker_ctx,
                                                                          tiny_gpt2_dir, tmp_path):
    dataset = upload(client, "\n".join(["some text to learn"] * 8).encode(), filename="corpus.txt").json()["id"]
    response = client.post("/jobs", json={"task": "causal-lm", "train_dataset": dataset,
                                          "base_model": str(tiny_gpt2_dir),
                                          "adapter": {"r": 2, "target_modules": ["c_attn"]}})
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    config = AdapterConfig(r=2, alpha=4, target_modules=["c_attn"])
    folder = make_adapters(tiny_gpt2_dir, tmp_path, {"gpt2": config})["gpt2"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    tokenizer.save_pretrained(folder)  # a LoRA job's artifact holds the tokenizer beside the adapter
    _finish(settings, job_id, folder)
    reply = client.post("/v1/completions", json={"model": job_id, "prompt": "Hello there", "max_tokens": 6,
                                                 "temperature": 0})
    assert reply.status_code == 200, reply.text
    ids = tokenizer("Hello there")["input_ids"]
    want = tokenizer.decode(hf_greedy(peft_model(tiny_gpt2_dir, folder), ids, 6), skip_special_tokens=True)
    assert reply.json()["choices"][0]["text"] == want
