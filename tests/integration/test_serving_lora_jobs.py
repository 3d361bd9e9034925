"""Many adapters, one base, one batch, on real workers: two LoRA chat jobs on one tiny Llama (different replies)
succeed with artifacts a small fraction of the base; then one concurrent burst through the `openai` client mixes
adapter A, adapter B and the base, and every greedy answer equals HF + PEFT on the downloaded adapter."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from transformers import AutoTokenizer

from tests.factories import upload
from tests.integration.test_lora_jobs import LM_HP, LORA, REPLIES, _download, _finished, _submit
from tests.tiny_adapters import hf_greedy, peft_model
from tests.tiny_chat import chat_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

CHATS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What colour is the sky?"}],
         [{"role": "user", "content": "Hello there!"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]]


def test_two_adapter_jobs_and_their_base_answer_as_peft_in_one_burst(live_client, start_worker, settings,
                                                                     tiny_llama_dir, tmp_path):
    base = settings.home / "models" / "tiny"
    shutil.copytree(tiny_llama_dir, base)  # servable by name, and the adapters' base_model
    settings.generation_wait_s = 120  # the first requests wait for the engine's load on a busy machine
    start_worker("training")
    start_worker("generation", TRAINSERVE_GENERATION_PRECISION="fp32", TRAINSERVE_MAX_LORAS="2")  # fp32: HF-exact
    datasets = [upload(live_client, chat_jsonl(reply), filename=f"chat{i}.jsonl").json()["id"]
                for i, reply in enumerate(REPLIES)]
    jobs = [_submit(live_client, {"task": "causal-lm", "base_model": "tiny", "train_dataset": dataset,
                                  "adapter": LORA, "hyperparameters": LM_HP}) for dataset in datasets]
    folders = {}
    for job_id in jobs:
        job = _finished(live_client, job_id)
        folders[job_id] = _download(live_client, job, tmp_path / job_id)
        adapter_bytes = (folders[job_id] / "adapter_model.safetensors").stat().st_size
        assert adapter_bytes < 0.2 * (base / "model.safetensors").stat().st_size  # a small fraction of the base
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
        ids = list(tokenizer.apply_chat_template(CHATS[index], add_generation_prompt=True, tokenize=True))
        assert answer == tokenizer.decode(hf_greedy(models[model], ids, 6), skip_special_tokens=True), (model, index)
    by_model = {model: [a for (m, _), a in zip(asks, answers, strict=True) if m == model] for model in models}
    assert by_model[jobs[0]] != by_model[jobs[1]] != by_model["tiny"]  # each adapter answers its own way
    assert any(REPLIES[0].rstrip(".") in a for a in by_model[jobs[0]])  # the first learned its reply
