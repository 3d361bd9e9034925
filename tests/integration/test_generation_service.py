"""GPT-2 end to end on real processes: a causal-lm job trains on tiny Shakespeare, a generation worker serves it
beside a Llama and a Qwen3."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.conftest import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data" / "tinyshakespeare_sample.txt"


def test_a_trained_gpt2_streams_and_bursts_beside_a_llama_and_a_qwen3_equal_to_hf(live_client, start_worker, settings):
    """One generation worker process serves the trained GPT-2 (streamed, through the openai client, in a burst past
    its queue bound) and, beside it, a Llama and a Qwen3 equal to HF generate."""
    from tests.tiny_llama import build_tiny_decoder

    models = {name: build_tiny_decoder(name, settings.home / "models" / name) for name in ("llama", "qwen3")}
    start_worker("training")
    start_worker("generation", device="cpu")  # fp32 (worker_env): HF-exact
    ds = live_client.post("/datasets", files={"file": ("shakespeare.txt", SAMPLE.read_bytes()[:30_000])}).json()
    body = {"task": "causal-lm", "train_dataset": ds["id"],
            "model_config": {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64},
            "hyperparameters": {"max_steps": 30, "batch_size": 8, "block_size": 32, "learning_rate": 3e-3,
                                "eval_steps": 15}}
    response = live_client.post("/jobs", json=body)
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    job = wait_for(lambda: (j := live_client.get(f"/jobs/{job_id}").json())["status"]
                   in ("succeeded", "failed") and j, 240, "the causal-lm job to finish")
    assert job["status"] == "succeeded", job["error"]
    assert {"eval_loss", "perplexity"} <= set(job["metrics"]) and job["model_config"]["n_layer"] == 2
    history = live_client.get(f"/jobs/{job_id}/metrics", params={"name": "tokens_per_second"}).json()["data"]
    assert len(history) == 30
    assert job_id in [m["id"] for m in live_client.get("/v1/models").json()["data"]]

    response = live_client.post("/generate", json={"model": job_id, "prompt": "ROMEO:\n", "max_new_tokens": 20,
                                                   "temperature": 0.8, "seed": 1, "stream": True})
    assert response.status_code == 200, response.text
    blocks = [b for b in response.text.split("\n\n") if b.strip()]
    assert blocks[-1] == "data: [DONE]"
    final = json.loads(blocks[-2].removeprefix("data: "))
    deltas = [json.loads(b.removeprefix("data: "))["text"] for b in blocks[:-2]]
    assert "".join(deltas) == final["choices"][0]["text"] and final["usage"]["completion_tokens"] > 0

    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url="http://testserver/v1", api_key=live_client.headers["Authorization"].split()[1],
                        http_client=live_client, max_retries=0)
    completion = api.completions.create(model=job_id, prompt="KING:", max_tokens=12, temperature=0)
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model=job_id, prompt="KING:", max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == completion.choices[0].text

    prompt = "Café naïve 🤖 First Citizen:"

    def complete(name: str):
        return live_client.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 10,
                                                         "temperature": 0})

    settings.generation_wait_s = 120  # the first request of each model waits for its load on a busy machine
    with ThreadPoolExecutor(max_workers=2) as pool:  # one worker process, both models at once
        responses = dict(zip(models, pool.map(complete, models), strict=True))
    for name, (model, tokenizer) in models.items():
        assert responses[name].status_code == 200, responses[name].text
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=0)
        expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert responses[name].json()["choices"][0]["text"] == expected

    # A burst well past the queue bound: some 429s, every accepted request answered, nothing hangs.
    settings.generation_queue_per_model = 4

    def one(i: int):
        return live_client.post("/generate", json={"model": job_id, "prompt": f"Line {i}:", "max_new_tokens": 24,
                                                   "temperature": 0.7, "seed": i})

    with ThreadPoolExecutor(max_workers=24) as pool:
        responses = list(pool.map(one, range(24), timeout=180))
    codes = [r.status_code for r in responses]
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
    for r in responses:
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] in ("length", "eos", "stop")
        else:
            assert r.headers["retry-after"]
