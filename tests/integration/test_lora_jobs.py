"""LoRA jobs end to end on real workers: chat SFT, DPO and classification adapters, downloads that PEFT loads, the
two chat adapters and their base served in one burst equal to HF + PEFT (many adapters, one base, one batch), and a
resume after SIGKILL that gives the adapter an uninterrupted run gives."""

from __future__ import annotations

import io
import math
import os
import shutil
import signal
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.factories import job_body, sentiment_rows, tsv_bytes, upload
from tests.integration.conftest import wait_for
from tests.tiny_adapters import hf_greedy, peft_model
from tests.tiny_chat import chat_jsonl, preference_jsonl
from worker.engines.training.chat import assistant_loss
from worker.engines.training.chat_render import collate, render_chat

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(480)]

LORA = {"r": 4, "alpha": 16, "dropout": 0.05, "target_modules": "all-linear"}
REPLIES = ("Blue.", "Four.")
LM_HP = {"max_steps": 24, "batch_size": 2, "learning_rate": 5e-2, "precision": "fp32", "block_size": 128}
CHATS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What colour is the sky?"}],
         [{"role": "user", "content": "Hello there!"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]]


def _finished(client, job_id: str, timeout: float = 300) -> dict:
    seen: list[dict] = []

    def ended() -> dict | None:
        seen[:] = [client.get(f"/jobs/{job_id}").json()]
        return seen[0] if seen[0]["status"] in ("succeeded", "failed", "cancelled") else None

    try:
        job = wait_for(ended, timeout, f"job {job_id} to finish")
    except AssertionError as exc:  # say where it stood: status, attempts, why it waits, its last events
        events = client.get(f"/jobs/{job_id}/events", params={"limit": 1000}).json()["data"][-8:]
        last = {k: seen[0].get(k) for k in ("status", "attempts", "waiting_reason", "progress", "error")}
        raise AssertionError(f"{exc}: {last}; last events {[(e['kind'], e['message']) for e in events]}") from None
    assert job["status"] == "succeeded", job["error"]
    return job


def _submit(client, body: dict) -> str:
    response = client.post("/jobs", json=body)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _download(client, job: dict, into: Path) -> Path:
    model = next(a for a in job["artifacts"] if a["kind"] == "model")
    response = client.get(model["download_url"])
    assert response.status_code == 200, response.text
    with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
        tar.extractall(into, filter="data")
    return into / "model"


def _chat_job(client, base: Path | str, dataset: str, **more) -> dict:
    return {"task": "causal-lm", "base_model": str(base), "train_dataset": dataset, "adapter": LORA,
            "hyperparameters": LM_HP, **more}


def _reply_loss(model, tokenizer, reply: str) -> float:
    examples = [render_chat(tokenizer, [{"role": "user", "content": q}, {"role": "assistant", "content": reply}])
                for q in ("Hello there!", "What colour is the sky?")]
    with torch.no_grad():
        return assistant_loss(model, None, **collate(examples, tokenizer.pad_token_id)).item()


def test_lora_sft_dpo_and_classification_jobs(live_client, start_worker, settings, tiny_llama_dir, tiny_bert_dir,
                                              tmp_path):
    base = settings.home / "models" / "tiny"
    shutil.copytree(tiny_llama_dir, base)  # servable by name, and the chat adapters' base_model
    settings.generation_wait_s = 120  # the first requests wait for the engine's load on a busy machine
    start_worker("training")
    start_worker("inference", device="auto")
    start_worker("generation", TRAINSERVE_GENERATION_PRECISION="fp32", TRAINSERVE_MAX_LORAS="2")  # fp32: HF-exact
    chats = [upload(live_client, chat_jsonl(reply), filename=f"chat{i}.jsonl").json()["id"]
             for i, reply in enumerate(REPLIES)]
    sft = [_submit(live_client, _chat_job(live_client, "tiny", ds)) for ds in chats]
    prefs = upload(live_client, preference_jsonl("Blue.", "Red."), filename="prefs.jsonl").json()["id"]
    dpo = _submit(live_client, _chat_job(live_client, tiny_llama_dir, prefs, eval_dataset=prefs,
                                         method={"method": "dpo", "beta": 0.5}))
    table = upload(live_client, tsv_bytes(sentiment_rows(4))).json()["id"]
    classifier = _submit(live_client, job_body(table, table, base_model=str(tiny_bert_dir), adapter={
        "r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["query", "value"]}, hyperparameters={
        "epochs": 8, "batch_size": 8, "learning_rate": 2e-2, "warmup_ratio": 0.1, "max_length": 32}))

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    base_bytes = (tiny_llama_dir / "model.safetensors").stat().st_size
    losses = []
    folders = {}
    for index, job_id in enumerate(sft):
        job = _finished(live_client, job_id)
        assert job["adapter"]["r"] == 4 and job["method"] == {"method": "sft"}
        folder = folders[job_id] = _download(live_client, job, tmp_path / job_id)
        assert (folder / "adapter_config.json").is_file() and not (folder / "model.safetensors").exists()
        assert (folder / "adapter_model.safetensors").stat().st_size < 0.2 * base_bytes  # a small fraction
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), str(folder)).eval()
        losses.append([_reply_loss(adapted, tokenizer, reply) for reply in REPLIES])
        assert losses[-1][index] < losses[-1][1 - index]  # each adapter learned its own reply
    _burst_equals_peft(live_client, base, sft, folders)
    job = _finished(live_client, dpo)
    assert job["method"] == {"method": "dpo", "beta": 0.5}
    assert job["metrics"]["eval_loss"] < math.log(2)  # where DPO starts (the adapter's B is zero)
    job = _finished(live_client, classifier)
    assert job["adapter"]["target_modules"] == ["query", "value"]
    assert job["metrics"]["eval_accuracy"] >= 0.75
    folder = _download(live_client, job, tmp_path / classifier)
    assert (folder / "adapter_model.safetensors").is_file()
    response = live_client.post("/classify", json={"model": classifier, "texts": ["i loved every minute",
                                                                                 "boring and far too long"]})
    assert response.status_code == 200, response.text
    assert [p["label"] for p in response.json()["predictions"]] == [1, 0]


def _burst_equals_peft(live_client, base: Path, jobs: list[str], folders: dict[str, Path]) -> None:
    """One concurrent burst through the `openai` client mixes both adapters and the base: every greedy answer equals
    HF + PEFT on the downloaded adapter, and each adapter answers its own way."""
    assert set(jobs) <= {m["id"] for m in live_client.get("/v1/models").json()["data"]}
    api = openai.OpenAI(base_url="http://testserver/v1", api_key=live_client.headers["Authorization"].split()[1],
                        http_client=live_client, max_retries=0)
    asks = [(model, index) for model in ("tiny", *jobs) for index in range(len(CHATS))]

    def ask(item):
        model, index = item
        reply = api.chat.completions.create(model=model, messages=CHATS[index], max_tokens=6, temperature=0)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(max_workers=len(asks)) as pool:  # one burst: rows of both adapters and the base
        answers = list(pool.map(ask, asks))
    tokenizer = AutoTokenizer.from_pretrained(base)
    models = {model: peft_model(base, folders.get(model)) for model in ("tiny", *jobs)}
    for (model, index), answer in zip(asks, answers, strict=True):
        ids = list(tokenizer.apply_chat_template(CHATS[index], add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
        assert answer == tokenizer.decode(hf_greedy(models[model], ids, 6), skip_special_tokens=True), (model, index)
    by_model = {model: [a for (m, _), a in zip(asks, answers, strict=True) if m == model] for model in models}
    assert by_model[jobs[0]] != by_model[jobs[1]] != by_model["tiny"]  # each adapter answers its own way
    assert any(REPLIES[0].rstrip(".") in a for a in by_model[jobs[0]])  # the first learned its reply


def test_a_sigkilled_lora_job_resumes_to_the_uninterrupted_adapter(live_client, start_worker, tiny_llama_dir,
                                                                   settings, tmp_path):
    dataset = upload(live_client, chat_jsonl(REPLIES[0]), filename="chat.jsonl").json()["id"]
    body = _chat_job(live_client, tiny_llama_dir, dataset, hyperparameters={**LM_HP, "max_steps": 30})
    victim = start_worker("training", TRAINSERVE_HEARTBEAT_TIMEOUT_S="4")
    killed = _submit(live_client, body)
    wait_for(lambda: live_client.get(f"/jobs/{killed}").json()["progress"]["step"] >= 12, 180, "a few steps")
    os.kill(victim.pid, signal.SIGKILL)  # the solo pool trains in the worker process itself
    victim.wait(30)
    start_worker("training", TRAINSERVE_HEARTBEAT_TIMEOUT_S="4")
    resumed = _finished(live_client, killed)
    assert resumed["attempts"] == 2
    events = live_client.get(f"/jobs/{killed}/events", params={"limit": 1000}).json()["data"]
    assert any("resumed from checkpoint at step" in e["message"] for e in events if e["kind"] == "started")
    straight = _finished(live_client, _submit(live_client, body))
    first, second = (load_file(_download(live_client, job, tmp_path / job["id"]) / "adapter_model.safetensors")
                     for job in (resumed, straight))
    assert first.keys() == second.keys() and first
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=0, atol=1e-6, msg=name)
    # base_model: a finished adapter job's id continues from its weights (the adapter folded into its base)
    follow = _finished(live_client, _submit(live_client, {**body, "base_model": straight["id"],
                                                          "hyperparameters": {**LM_HP, "max_steps": 4}}))
    assert follow["base_model"] == straight["id"]
    folder = _download(live_client, follow, tmp_path / follow["id"])
    assert load_file(folder / "adapter_model.safetensors").keys() == first.keys()
