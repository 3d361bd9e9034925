"""/generate, /v1/completions and /v1/models through the real gateway, Redis streams and a tiny GPT-2.

The Celery hop is replaced by a queue that runs the worker's real `serve` function in a thread.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis as redis_lib
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.tasks import TASK_GENERATE


def _reference_greedy(path, prompt, max_new_tokens):
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=50256)
    return tokenizer.decode(out[0, ids.shape[1]:])


def test_models_lists_local_models(client, served):
    data = client.get("/v1/models").json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == ["tiny"]


def test_greedy_generate_equals_model_generate(client, served):
    response = client.post("/generate", json={"model": "tiny", "prompt": "ROMEO:", "max_new_tokens": 12,
                                              "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == "tiny" and body["id"].startswith("gen-")
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("length", "eos")
    assert choice["text"] == _reference_greedy(served, "ROMEO:", 12)
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] <= 12


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_choices(client, served):
    body = {"model": "tiny", "prompt": "To be", "max_new_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3}
    first = client.post("/generate", json=body).json()
    second = client.post("/generate", json=body).json()
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in second["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in first["choices"]}) > 1


def _sse(response):
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines.get("event"), lines["data"]))
    return events


def test_streaming_sends_tokens_then_the_full_text_then_done(client, served):
    response = client.post("/generate", json={"model": "tiny", "prompt": "ROMEO:", "max_new_tokens": 10,
                                              "temperature": 0, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = _sse(response)
    assert events[-1] == (None, "[DONE]")
    final = json.loads(events[-2][1])
    tokens = [json.loads(data) for _, data in events[:-2]]
    assert tokens and all(set(t) == {"id", "index", "text"} for t in tokens)
    assert "".join(t["text"] for t in tokens) == final["choices"][0]["text"]
    assert final["choices"][0]["text"] == _reference_greedy(served, "ROMEO:", 10)


def test_validation_errors_name_the_field(client, served, settings):
    cases = [({"top_p": 0}, 422, "top_p"), ({"model": "nope"}, 404, "model"), ({"n": 0}, 422, "n"),
             ({"stop": ["a"] * 5}, 422, "stop"), ({"max_new_tokens": 60, "prompt": "word " * 10}, 422,
                                                   "max_new_tokens"),
             ({"model": "../models/tiny"}, 404, "model")]
    for override, status, field in cases:
        body = {"model": "tiny", "prompt": "hi", "max_new_tokens": 4, **override}
        response = client.post("/generate", json=body)
        assert response.status_code == status, (override, response.text)
        assert response.json()["error"]["field"] == field, (override, response.json())
    settings.max_new_tokens = 8
    response = client.post("/generate", json={"model": "tiny", "prompt": "hi", "max_new_tokens": 9})
    assert response.status_code == 422 and response.json()["error"]["field"] == "max_new_tokens"


def test_full_queue_gives_429_with_retry_after(client, served, settings):
    # Other tenants hold the model's whole queue and the share a newcomer would still get beside them.
    settings.generation_queue_per_model, settings.generation_queue_per_tenant = 2, 1
    slots = redis_lib.Redis.from_url(settings.resolved_redis_url)
    slots.zadd("trainserve:slots:tiny", {f"held-{row}": time.time() for row in range(3)})
    try:
        response = client.post("/generate", json={"model": "tiny", "prompt": "hi"})
        assert response.status_code == 429 and response.json()["error"]["code"] == "overloaded"
        assert int(response.headers["retry-after"]) >= 1
    finally:
        slots.delete("trainserve:slots:tiny")
        slots.close()
    assert client.post("/generate", json={"model": "tiny", "prompt": "hi"}).status_code == 200


def test_rate_limit_per_key(client, served, settings):
    settings.generation_rate_per_minute = 2
    codes = [client.post("/generate", json={"model": "tiny", "prompt": "hi", "max_new_tokens": 2}).status_code
             for _ in range(3)]
    assert codes[:2] == [200, 200] and codes[2] == 429


def test_official_openai_client_completes_and_streams(client, served):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url="http://testserver/v1", api_key=client.headers["Authorization"].split()[1],
                        http_client=client, max_retries=0)
    completion = api.completions.create(model="tiny", prompt="ROMEO:", max_tokens=10, temperature=0)
    assert completion.object == "text_completion"
    assert completion.choices[0].text == _reference_greedy(served, "ROMEO:", 10)
    assert completion.usage.prompt_tokens == 3
    assert completion.choices[0].finish_reason in ("length", "stop")
    chunks = list(api.completions.create(model="tiny", prompt="ROMEO:", max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == completion.choices[0].text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    seeded = [api.completions.create(model="tiny", prompt="Hi", max_tokens=6, seed=3, n=2, stop=["\n"])
              for _ in range(2)]
    assert [c.text for c in seeded[0].choices] == [c.text for c in seeded[1].choices]
    with pytest.raises(openai.UnprocessableEntityError):
        api.completions.create(model="tiny", prompt="Hi", suffix="!")
    models = api.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_a_token_written_before_accepted_is_not_lost(client, settings, queue, served):
    """The engine's scheduler thread may stream a token before the submitting thread writes `accepted`."""
    from core.protocol import AcceptedEvent, ChoiceOut, DoneEvent, TokenEvent, Usage
    from core.redis_keys import stream_key

    def worker(payload):
        store = redis_lib.Redis.from_url(settings.resolved_redis_url)
        done = DoneEvent(choices=[ChoiceOut(index=0, text="ab", finish_reason="length")],
                         usage=Usage(prompt_tokens=1, completion_tokens=2))
        for event in (TokenEvent(index=0, text="a"), AcceptedEvent(prompt_tokens=1), TokenEvent(index=0, text="b"),
                      done):
            store.xadd(stream_key(payload["request_id"]), {"data": event.model_dump_json()})
        store.close()

    queue.handlers[TASK_GENERATE] = worker
    body = {"model": "tiny", "prompt": "hi", "max_new_tokens": 2}
    assert client.post("/generate", json=body).json()["choices"][0]["text"] == "ab"
    events = _sse(client.post("/generate", json={**body, "stream": True}))
    assert [json.loads(data)["text"] for _, data in events[:2]] == ["a", "b"]


def test_a_concurrent_burst_gets_exactly_the_bound_of_slots(settings, queue):
    """Admission is atomic: of 20 racing requests, 6 pass a rate limit of 6 and exactly 4 of them get the 4 slots."""
    import asyncio

    from app.services.generation import GenerationGateway
    from core.auth import Principal
    from core.errors import TooManyRequests
    from core.redis_client import async_redis_from_url
    from core.served_models import ServedModel

    settings.generation_queue_per_model, settings.generation_rate_per_minute = 4, 6
    model = ServedModel(id=f"burst-{time.time_ns()}", path="/nowhere", owned_by="local", created=0)

    async def burst(principal: Principal) -> list[str]:
        redis = async_redis_from_url(settings.resolved_redis_url)
        gateway = GenerationGateway(redis, queue, settings)
        results = await asyncio.gather(*(gateway.admit(principal, model) for _ in range(20)), return_exceptions=True)
        await redis.aclose()
        assert all(isinstance(r, str) or isinstance(r, TooManyRequests) for r in results), results
        return [r.code for r in results if isinstance(r, TooManyRequests)]

    first = asyncio.run(burst(Principal(key_id=f"key_a{time.time_ns()}", tenant_id="t", is_admin=False)))
    assert first.count("rate_limited") == 14 and first.count("overloaded") == 2  # 4 admitted: the bound, not zero
    second = asyncio.run(burst(Principal(key_id=f"key_b{time.time_ns()}", tenant_id="t", is_admin=False)))
    assert second.count("rate_limited") == 14 and second.count("overloaded") == 6  # slots still held by the first


def test_a_lone_tenant_fills_the_models_queue_and_a_newcomer_still_gets_its_share_counted_in_rows(settings, queue):
    """Work-conserving, in rows: a tenant alone on a model may hold its whole queue (n=16 requests, 48 rows); another
    tenant arriving then is still admitted up to its share, beyond the model's queue; while both hold rows, each is
    held to its share, and the model to both bounds together; releasing gives back every row."""
    import asyncio

    from app.services.generation import GenerationGateway
    from core.auth import Principal
    from core.errors import TooManyRequests
    from core.redis_client import async_redis_from_url
    from core.served_models import ServedModel

    settings.generation_queue_per_model, settings.generation_queue_per_tenant = 48, 32
    model = ServedModel(id=f"share-{time.time_ns()}", path="/nowhere", owned_by="local", created=0)
    flood = Principal(key_id=f"key_f{time.time_ns()}", tenant_id="flood", is_admin=False)
    other = Principal(key_id=f"key_o{time.time_ns()}", tenant_id="other", is_admin=False)

    async def scenario() -> None:
        redis = async_redis_from_url(settings.resolved_redis_url)
        gateway = GenerationGateway(redis, queue, settings)
        held = [await gateway.admit(flood, model, 16) for _ in range(3)]  # 48 rows: alone, the whole queue
        with pytest.raises(TooManyRequests, match="whole generation queue"):
            await gateway.admit(flood, model, 1)
        mine = [await gateway.admit(other, model, 16) for _ in range(2)]  # its share, past the model's 48
        with pytest.raises(TooManyRequests, match="this tenant has 32 generation rows"):
            await gateway.admit(other, model, 1)
        with pytest.raises(TooManyRequests, match="this tenant has 32 generation rows"):
            await gateway.admit(flood, model, 1)  # another tenant holds rows: the flood is held to its share
        await gateway.release(held[0], model, finished=True, tenant="flood", rows=16)
        await gateway.release(held[1], model, finished=True, tenant="flood", rows=16)
        await gateway.admit(flood, model, 16)  # 32 of its own, 80 in all: both bounds together
        await gateway.release(mine[0], model, finished=True, tenant="other", rows=16)
        await gateway.release(mine[1], model, finished=True, tenant="other", rows=16)
        await gateway.admit(flood, model, 16)  # alone again: past its share, within the model's queue
        await redis.aclose()

    asyncio.run(scenario())


@pytest.fixture()
def served_decoders(settings, worker_ctx):
    """A tiny Llama (Llama-2-style tokenizer) and a tiny Qwen3 (byte-level BPE) served by one worker."""
    from tests.tiny_llama import build_tiny_decoder

    return {name: build_tiny_decoder(name, settings.home / "models" / name) for name in ("llama", "qwen3")}


def test_llama_and_qwen3_complete_greedily_as_hf_generate_side_by_side(client, served_decoders):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url="http://testserver/v1", api_key=client.headers["Authorization"].split()[1],
                        http_client=client, max_retries=0)
    prompts = {"llama": "Café naïve 🤖 First Citizen:", "qwen3": "Before we proceed any further, déjà vu"}

    def complete(name: str):
        return api.completions.create(model=name, prompt=prompts[name], max_tokens=12, temperature=0)

    with ThreadPoolExecutor(max_workers=2) as pool:  # both models served at once by the one worker
        completions = dict(zip(prompts, pool.map(complete, prompts), strict=True))
    for name, (model, tokenizer) in served_decoders.items():
        ids = tokenizer(prompts[name])["input_ids"]  # the Llama tokenizer adds its BOS, as the engine does
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, pad_token_id=0)
        assert completions[name].choices[0].text == tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        assert completions[name].usage.prompt_tokens == len(ids)
        chunks = api.completions.create(model=name, prompt=prompts[name], max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == completions[name].choices[0].text


def test_an_unsupported_architecture_is_refused_naming_model(client, settings, worker_ctx):
    # Any causal LM transformers defines is served; one whose code ships with its checkpoint (auto_map) is not.
    folder = settings.home / "models" / "custom"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "custom_lm", "architectures": ["CustomForCausalLM"],
        "auto_map": {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}}))
    (folder / "model.safetensors").write_bytes(b"")
    response = client.post("/v1/completions", json={"model": "custom", "prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "model" and "'custom_lm'" in error["message"] and "trust_remote_code" in \
        error["message"]
