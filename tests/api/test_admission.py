"""POST /jobs refuses, with 422 does_not_fit, a job whose estimated memory fits no live worker's device."""

from __future__ import annotations

import json

import pytest

from core import capacity
from core.redis_client import redis_from_url
from core.redis_keys import CAPACITY_PREFIX
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload

WIDE = {"n_layer": 96, "n_embd": 12288, "n_head": 96, "n_positions": 256}
GB = 1024**3


@pytest.fixture()
def board(settings):
    """The test database's Redis, with no capacity report before or after the test."""
    client = redis_from_url(settings.resolved_redis_url)

    def clear() -> None:
        for key in client.scan_iter(match=CAPACITY_PREFIX + "*"):
            client.delete(key)

    clear()
    yield client
    clear()
    client.close()


@pytest.fixture()
def corpus_id(client):
    text = "\n".join(f"line {i} of a small corpus for a tiny language model" for i in range(40))
    return upload(client, text.encode(), filename="corpus.txt").json()["id"]


def lm_body(corpus_id: str, model_config: dict | None = None, **hyperparameters) -> dict:
    return {"task": "causal-lm", "train_dataset": corpus_id, "model_config": model_config or {},
            "hyperparameters": hyperparameters}


def _refused(response, field: str) -> str:
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert (error["code"], error["field"]) == ("does_not_fit", field), error
    return error["message"]


def test_a_96_layer_12288_wide_gpt2_is_refused_naming_the_estimate(client, queue, board, corpus_id):
    message = _refused(client.post("/jobs", json=lm_body(corpus_id, WIDE)), "model_config")
    assert "174.6B parameters" in message and "TB" in message
    assert "85.9 GB assumed while no live worker has reported" in message  # TRAINSERVE_ASSUMED_DEVICE_BYTES
    assert queue.sent == [] and client.get("/jobs").json()["data"] == []


def test_a_1024_by_32768_micro_batch_is_refused_naming_the_batch(client, queue, board, corpus_id):
    body = lm_body(corpus_id, {"n_positions": 32768}, batch_size=1024, block_size=32768)
    message = _refused(client.post("/jobs", json=body), "hyperparameters.batch_size")
    assert "33554432 tokens per micro-batch" in message and "gradient_accumulation_steps" in message
    assert queue.sent == []


def test_normal_jobs_are_still_accepted(client, queue, board, corpus_id):
    small = lm_body(corpus_id, {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64}, batch_size=8)
    assert client.post("/jobs", json=small).status_code == 201
    train = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    assert client.post("/jobs", json=job_body(train)).status_code == 201
    assert len(queue.sent) == 2


def test_the_largest_reported_device_is_the_limit(client, queue, board, corpus_id):
    default = lm_body(corpus_id)  # nanoGPT's baby GPT, 8 x 256 tokens: 1.9 GB with gradient checkpointing
    capacity.publish(board, capacity.DeviceCapacity(worker="small:1", device="cpu", total_bytes=int(1.7 * GB)),
                     ttl_s=60)
    message = _refused(client.post("/jobs", json=default), "hyperparameters.batch_size")
    assert "the largest device a live worker has reported (cpu on small:1, 1.8 GB)" in message
    assert "with gradient checkpointing" in message  # the estimate already counts it
    train = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    big_batch = job_body(train, hyperparameters={"batch_size": 1024, "max_length": 512})
    _refused(client.post("/jobs", json=big_batch), "hyperparameters.batch_size")  # MiniLM, 524288 tokens

    capacity.publish(board, capacity.DeviceCapacity(worker="gpu:2", device="cuda:0", total_bytes=40 * GB), ttl_s=60)
    assert client.post("/jobs", json=default).status_code == 201
    # 524288 tokens of MiniLM fit 40 GB only with gradient checkpointing, which a job gets unless it turns it off.
    assert client.post("/jobs", json=big_batch).status_code == 201
    big_batch["hyperparameters"]["gradient_checkpointing"] = False
    _refused(client.post("/jobs", json=big_batch), "hyperparameters.gradient_checkpointing")
    _refused(client.post("/jobs", json=lm_body(corpus_id, WIDE)), "model_config")

    capacity.withdraw(board, "gpu:2")
    assert client.post("/jobs", json=default).status_code == 422


def test_devices_beyond_every_live_worker_are_refused_and_others_go_to_their_size_queue(client, queue, board):
    train = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    two = job_body(train, devices=2)
    assert client.post("/jobs", json=two).status_code == 201  # no worker has reported yet: it waits for one
    capacity.publish(board, capacity.DeviceCapacity(worker="one:1", device="cuda:0", total_bytes=40 * GB), ttl_s=60)
    capacity.publish(board, capacity.DeviceCapacity(worker="pair:2", device="cuda:0", total_bytes=40 * GB,
                                                    devices=2), ttl_s=60)
    message = _refused(client.post("/jobs", json=job_body(train, devices=3)), "devices")
    assert "at most 2 (cuda:0 on pair:2)" in message
    response = client.post("/jobs", json=two)
    assert response.status_code == 201 and response.json()["devices"] == 2
    assert [sent[2] for sent in queue.sent] == ["training.2", "training.2"]  # only 2-device workers consume it
    for bad in (0, 65, "two"):
        response = client.post("/jobs", json=job_body(train, devices=bad))
        assert response.status_code == 422 and response.json()["error"]["field"] == "devices", response.text


# SmolLM2-135M-Instruct's config.json (Llama-shaped: 30 layers, 576 wide, 8,192 positions, a 49,152 vocabulary).
SMOLLM2_135M = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "max_position_embeddings": 8192, "vocab_size": 49152,
                "rope_theta": 100000, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


def _smollm2(settings) -> str:
    from tests.tiny_chat import build_tiny_llama

    folder = build_tiny_llama(settings.home / "models" / "smollm2-135m")
    (folder / "config.json").write_text(json.dumps(SMOLLM2_135M))  # the API reads the config only
    return str(folder)


def test_a_default_lora_job_of_a_135m_model_on_short_chats_is_admitted(client, queue, board, settings):
    """Its micro-batch is bounded by the data's longest conversation (stored at validation), not by 2,048 tokens
    per conversation."""
    from tests.tiny_chat import chat_jsonl

    dataset = upload(client, chat_jsonl("Blue.", repeat=8), filename="chats.jsonl").json()
    assert dataset["format"] == "chat" and dataset["rows"] == 48
    # 8 x 216 tokens fit 3 GB with gradient checkpointing; 8 x 2,048 need about 4.5 GB even with it.
    capacity.publish(board, capacity.DeviceCapacity(worker="cpu:1", device="cpu", total_bytes=3 * 10**9), ttl_s=60)
    body = {"task": "causal-lm", "train_dataset": dataset["id"], "base_model": _smollm2(settings), "adapter": {}}
    response = client.post("/jobs", json=body)
    assert response.status_code == 201, response.text
    # The bound is the data's: one long conversation makes the batch 8 x 2,048 tokens (cut at 2,048), refused.
    long = {"messages": [{"role": "user", "content": "why? " * 900}, {"role": "assistant", "content": "Blue."}]}
    body["train_dataset"] = upload(client, json.dumps(long).encode() + b"\n" + chat_jsonl("Blue."),
                                   filename="long.jsonl").json()["id"]
    assert "16384 tokens per micro-batch" in _refused(client.post("/jobs", json=body), "hyperparameters.batch_size")


def test_a_default_lora_job_of_smollm2_on_2k_token_chats_fits_24_gb_with_gradient_checkpointing(
        client, queue, board, settings):
    """8 conversations of 2,048 tokens a micro-batch: about 40 GB with every layer's activations kept, a few GB
    with gradient checkpointing and the chunked loss (which the worker turns on by itself when it is needed)."""
    long = [{"messages": [{"role": "user", "content": "why? " * 900}, {"role": "assistant", "content": "Blue. " * 200}]}
            for _ in range(4)]
    dataset = upload(client, "".join(json.dumps(r) + "\n" for r in long).encode(), filename="long.jsonl").json()
    capacity.publish(board, capacity.DeviceCapacity(worker="cpu:1", device="cpu", total_bytes=24 * 10**9), ttl_s=60)
    body = {"task": "causal-lm", "train_dataset": dataset["id"], "base_model": _smollm2(settings), "adapter": {}}
    response = client.post("/jobs", json=body)
    assert response.status_code == 201, response.text
    body["hyperparameters"] = {"gradient_checkpointing": False}
    message = _refused(client.post("/jobs", json=body), "hyperparameters.gradient_checkpointing")
    assert "16384 tokens per micro-batch" in message and "fits with gradient checkpointing" in message
    body["hyperparameters"] = {"gradient_checkpointing": False, "offload_activations": True}
    response = client.post("/jobs", json=body)
    assert response.status_code == 422 and "offload_activations" in response.text, response.text


def test_a_default_reinforcement_job_of_smollm2_in_full_fits_24_gb(client, queue, board, settings):
    """Batch 8, 4 samples a prompt, 32-token answers: 32 rows of prompt and answer. Refused before the chunked loss
    and gradient checkpointing as needing about 30 GB, 28.6 GB of it activations for 7,680 tokens."""
    prompts = [{"messages": [{"role": "user", "content": "add these up: " + "1 + " * 100 + "1"}], "answer": "101"}
               for _ in range(8)]
    dataset = upload(client, "".join(json.dumps(r) + "\n" for r in prompts).encode(), filename="p.jsonl").json()
    assert dataset["format"] == "prompts"
    capacity.publish(board, capacity.DeviceCapacity(worker="cpu:1", device="cpu", total_bytes=24 * 10**9), ttl_s=60)
    grader = {"type": "string_check", "name": "sum", "input": "{{sample.output_text}}",
              "reference": "{{item.answer}}", "operation": "like"}
    body = {"task": "causal-lm", "train_dataset": dataset["id"], "base_model": _smollm2(settings),
            "method": {"method": "reinforcement", "grader": grader, "beta": 0}}  # full weights: no KL reference
    response = client.post("/jobs", json=body)
    assert response.status_code == 201, response.text


def test_a_sharded_job_needs_a_device_to_hold_its_share_of_the_states(client, queue, board, corpus_id):
    # A 354M-parameter GPT-2 in bf16: about 7 GB on one device, 4 GB a device when FSDP splits it over two.
    medium = {"n_layer": 24, "n_embd": 1024, "n_head": 16, "n_positions": 64}
    capacity.publish(board, capacity.DeviceCapacity(worker="pair:2", device="cuda:0", total_bytes=5 * GB,
                                                    devices=2), ttl_s=60)
    whole = dict(lm_body(corpus_id, medium, batch_size=2, sharding="ddp"), devices=2)
    _refused(client.post("/jobs", json=whole), "model_config")
    sharded = dict(lm_body(corpus_id, medium, batch_size=2), devices=2)  # sharding auto: fsdp
    response = client.post("/jobs", json=sharded)
    assert response.status_code == 201, response.text


def test_nodes_beyond_the_live_workers_owning_the_devices_are_refused(client, queue, board):
    train = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    for name in ("a:1", "b:2"):
        capacity.publish(board, capacity.DeviceCapacity(worker=name, device="cuda:0", total_bytes=40 * GB), ttl_s=60)
    capacity.publish(board, capacity.DeviceCapacity(worker="pair:3", device="cuda:0", total_bytes=40 * GB,
                                                    devices=2), ttl_s=60)
    response = client.post("/jobs", json=job_body(train, nodes=3))  # three workers own one device or more
    assert response.status_code == 201 and response.json()["nodes"] == 3
    assert "1 live training worker owns 2 or more" in _refused(client.post("/jobs", json=job_body(train, nodes=2,
                                                                                                  devices=2)), "nodes")
    assert queue.sent[-1][2] == "training"  # claimed from its size's queue by the head, like any job
    for bad in (0, 17):
        response = client.post("/jobs", json=job_body(train, nodes=bad))
        assert response.status_code == 422 and response.json()["error"]["field"] == "nodes", response.text
