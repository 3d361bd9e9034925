"""/v1/batches through the official openai client: validation (file, purpose, endpoint), a batch with a bad line
run by the generation worker code in-process (greedy outputs equal the interactive route's, the bad line in the
error file with its custom_id), an embeddings batch equal to the interactive route and to sentence-transformers,
list/retrieve/cancel shapes, and a resumed batch that never reruns a done line."""

from __future__ import annotations

import base64
import json
import time

import numpy as np
import openai
import pytest

from core.batches import part_key
from core.tasks import TASK_BATCH
from tests.tiny_lm import build_tiny_gpt2

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


def _line(custom_id: str, url: str, body: dict) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode() + b"\n"


def _chat(custom_id: str, content: str, model: str = "tiny", **more) -> bytes:
    return _line(custom_id, "/v1/chat/completions",
                 {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 6,
                  "temperature": 0, **more})


@pytest.fixture()
def served(settings, worker_ctx, queue):
    """A tiny GPT-2 with a chat template as <home>/models/tiny; batch tasks run by the worker code in-process."""
    from transformers import AutoTokenizer

    from worker.batches.run import run_batch

    path = build_tiny_gpt2(settings.home / "models" / "tiny", n_positions=64)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    queue.handlers[TASK_BATCH] = lambda batch_id: run_batch(worker_ctx, batch_id)
    return path


@pytest.fixture()
def api(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=client.headers["Authorization"].split()[1],
                         http_client=client, max_retries=0)


def _wait(api, batch_id: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while True:
        batch = api.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled") or time.monotonic() > deadline:
            return batch
        time.sleep(0.1)


def _lines(api, file_id: str) -> list[dict]:
    return [json.loads(line) for line in api.files.content(file_id).read().splitlines()]


def test_a_batch_with_a_bad_line_completes_and_matches_the_interactive_route(api, served):
    data = (_chat("a", "Name a colour") + _chat("b", "Say hi", model="no-such-model")
            + _chat("c", "Count to three") + _chat("d", "x", max_tokens=100_000))
    upload = api.files.create(file=("requests.jsonl", data), purpose="batch")
    batch = api.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"run": "t1"})
    assert batch.object == "batch" and batch.status == "in_progress" and batch.request_counts.total == 4
    assert batch.metadata == {"run": "t1"} and batch.expires_at - batch.created_at == 24 * 3600
    done = _wait(api, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 2)
    assert done.completed_at and done.finalizing_at and done.in_progress_at
    output = {line["custom_id"]: line for line in _lines(api, done.output_file_id)}
    errors = {line["custom_id"]: line for line in _lines(api, done.error_file_id)}
    assert sorted(output) == ["a", "c"] and sorted(errors) == ["b", "d"]
    assert errors["b"]["response"]["status_code"] == 404
    assert errors["b"]["response"]["body"]["error"]["param"] == "model"
    assert errors["d"]["response"]["status_code"] == 422
    assert errors["d"]["response"]["body"]["error"]["param"] == "max_tokens"  # the line's own field
    for custom_id, content in (("a", "Name a colour"), ("c", "Count to three")):
        line = output[custom_id]
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"].startswith("req_")
        body = line["response"]["body"]
        interactive = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                                  max_tokens=6, temperature=0)
        assert body["choices"][0]["message"]["content"] == interactive.choices[0].message.content != ""
        assert body["usage"] == interactive.usage.model_dump(exclude_none=True)
        assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert api.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert [f.id for f in api.files.list(purpose="batch_output")] != []
    assert [b.id for b in api.batches.list()] == [batch.id]


def test_completions_lines_equal_the_interactive_route(api, served):
    data = _line("p", "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0})
    upload = api.files.create(file=("c.jsonl", data), purpose="batch")
    done = _wait(api, api.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                         completion_window="24h").id)
    assert done.status == "completed" and done.error_file_id is None
    [line] = _lines(api, done.output_file_id)
    interactive = api.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
    assert line["response"]["body"]["choices"][0]["text"] == interactive.choices[0].text


def test_a_line_past_the_models_context_is_refused_naming_the_field_it_sent(api, served):
    data = (_chat("old", "hi", max_tokens=64) + _chat("new", "hi", max_tokens=None, max_completion_tokens=64)
            + _chat("fits", "hi"))
    upload = api.files.create(file=("ctx.jsonl", data), purpose="batch")
    done = _wait(api, api.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (1, 2)
    errors = {line["custom_id"]: line["response"] for line in _lines(api, done.error_file_id)}
    for custom_id, field in (("old", "max_tokens"), ("new", "max_completion_tokens")):
        error = errors[custom_id]["body"]["error"]
        assert errors[custom_id]["status_code"] == 422 and error["param"] == field, error
        assert f"+ {field} (64)" in error["message"] and "context length of 64" in error["message"]


EMBED_TEXTS = ["A cat sits on the mat.", "Stock markets fell sharply today.", "Café naïve 🤖 résumé"]


def test_an_embeddings_batch_equals_the_interactive_route_and_sentence_transformers(
        api, served, worker_ctx, queue):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    from core.pretrained import builtin_aliases
    from core.tasks import TASK_EMBED
    from worker.servers import embeddings as embedding

    queue.handlers[TASK_EMBED] = lambda payload: embedding.serve_embed(worker_ctx, payload)
    minilm = builtin_aliases()["minilm-l6"]
    ids = AutoTokenizer.from_pretrained(minilm)(EMBED_TEXTS[1], add_special_tokens=False)["input_ids"]
    lines = {"texts": {"input": EMBED_TEXTS}, "one": {"input": EMBED_TEXTS[2], "encoding_format": "base64"},
             "ids": {"input": [ids, ids]}, "gpt2": {"input": "hi", "model": "tiny"},
             "empty": {"input": ["ok", " "]}, "short": {"input": "x", "dimensions": 64}}
    data = b"".join(_line(cid, "/v1/embeddings", {"model": "minilm-l6", **body}) for cid, body in lines.items())
    upload = api.files.create(file=("e.jsonl", data), purpose="batch")
    done = _wait(api, api.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                         completion_window="24h").id)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 3)
    output = {line["custom_id"]: line["response"]["body"] for line in _lines(api, done.output_file_id)}
    errors = {line["custom_id"]: line["response"] for line in _lines(api, done.error_file_id)}
    assert sorted(errors) == ["empty", "gpt2", "short"]
    assert errors["gpt2"]["status_code"] == 404 and errors["gpt2"]["body"]["error"]["param"] == "model"
    assert errors["empty"]["status_code"] == 422 and errors["empty"]["body"]["error"]["param"] == "input.1"
    assert errors["short"]["status_code"] == 422 and errors["short"]["body"]["error"]["param"] == "dimensions"

    texts = output["texts"]
    got = np.array([d["embedding"] for d in texts["data"]], dtype=np.float32)
    interactive = api.embeddings.create(model="minilm-l6", input=EMBED_TEXTS, encoding_format="float")
    np.testing.assert_allclose(got, [d.embedding for d in interactive.data], atol=1e-5)
    assert texts["usage"] == interactive.usage.model_dump() and texts["model"] == "minilm-l6"
    assert [d["index"] for d in texts["data"]] == [0, 1, 2] and texts["object"] == "list"
    expected = SentenceTransformer(str(minilm), device="cpu").encode(EMBED_TEXTS, convert_to_numpy=True)
    cosines = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosines.min() >= 0.999, cosines
    # base64 is little-endian float32; token ids embed as their text does
    [packed] = output["one"]["data"]
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(packed["embedding"]), dtype="<f4"), got[2], atol=1e-5)
    np.testing.assert_allclose([d["embedding"] for d in output["ids"]["data"]], [got[1], got[1]], atol=1e-5)


def test_validation_errors_name_the_field(api, client, served):
    with pytest.raises(openai.NotFoundError) as missing:
        api.batches.create(input_file_id="file_" + "0" * 24, endpoint="/v1/chat/completions",
                           completion_window="24h")
    assert missing.value.body["param"] == "input_file_id"
    tune = api.files.create(file=("t.jsonl", b'{"prompt": "a", "completion": "b"}\n'), purpose="fine-tune")
    with pytest.raises(openai.UnprocessableEntityError) as purpose:
        api.batches.create(input_file_id=tune.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert purpose.value.body["param"] == "input_file_id"
    upload = api.files.create(file=("r.jsonl", _chat("a", "hi")), purpose="batch")
    with pytest.raises(openai.UnprocessableEntityError) as mismatch:
        api.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    assert mismatch.value.body["param"] == "input_file_id" and "endpoint" in mismatch.value.body["message"]
    answer = client.post("/v1/batches", json={"input_file_id": upload.id, "endpoint": "/v1/chat/completions",
                                              "completion_window": "1h"})
    assert answer.status_code == 422 and answer.json()["error"]["param"] == "completion_window"
    with pytest.raises(openai.NotFoundError):
        api.batches.retrieve("batch_" + "0" * 24)


def test_cancel_before_the_worker_and_after_the_end(api, served, worker_ctx, queue):
    from worker.batches.run import run_batch

    queue.handlers.pop(TASK_BATCH)  # no worker yet: the batch waits in the queue
    upload = api.files.create(file=("r.jsonl", _chat("a", "hi") + _chat("b", "yo")), purpose="batch")
    batch = api.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    cancelling = api.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    run_batch(worker_ctx, batch.id)  # the task starts, sees the cancel before its first chunk
    cancelled = api.batches.retrieve(batch.id)
    assert cancelled.status == "cancelled" and cancelled.request_counts.completed == 0
    assert cancelled.output_file_id is None and cancelled.cancelled_at
    assert api.batches.cancel(batch.id).status == "cancelled"
    other = api.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    run_batch(worker_ctx, other.id)
    assert api.batches.retrieve(other.id).status == "completed"
    with pytest.raises(openai.ConflictError):
        api.batches.cancel(other.id)
    run_batch(worker_ctx, other.id)  # a redelivery after the end changes nothing
    assert api.batches.retrieve(other.id).request_counts.completed == 2


def test_a_resumed_batch_never_reruns_a_done_line(api, served, settings, worker_ctx, queue, monkeypatch):
    from worker.batches import run as batches

    queue.handlers.pop(TASK_BATCH)
    settings.batch_chunk_lines = 2
    data = b"".join(_chat(f"r{i}", f"line {i}") for i in range(5))
    upload = api.files.create(file=("r.jsonl", data), purpose="batch")
    batch = api.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    ran: list[int] = []
    real = batches.run_chunk

    def dies_after_one_chunk(service, batch_id, first, lines, share):
        if ran:
            raise SystemExit("worker killed")  # as a SIGKILL between chunks: the first part is stored
        ran.extend(range(first, first + len(lines)))
        return real(service, batch_id, first, lines, share)

    monkeypatch.setattr(batches, "run_chunk", dies_after_one_chunk)
    with pytest.raises(SystemExit):
        batches.run_batch(worker_ctx, batch.id)
    assert worker_ctx.storage.exists(part_key(batch.id, 0)) and api.batches.retrieve(batch.id).status == "in_progress"
    assert ran == [0, 1]

    def counts(service, batch_id, first, lines, share):
        ran.extend(range(first, first + len(lines)))
        return real(service, batch_id, first, lines, share)

    monkeypatch.setattr(batches, "run_chunk", counts)
    batches.run_batch(worker_ctx, batch.id)  # the redelivered task
    assert ran == [0, 1, 2, 3, 4]
    done = api.batches.retrieve(batch.id)
    assert done.status == "completed" and done.request_counts.completed == 5
    assert [line["custom_id"] for line in _lines(api, done.output_file_id)] == [f"r{i}" for i in range(5)]


def test_a_silent_batch_is_handed_on_once_and_runs_under_one_lease(api, served, settings, worker_ctx, queue):
    from datetime import timedelta

    from core.db import session_scope
    from core.rows import Batch, utcnow
    from worker.batches.leases import Lease, resume_stale
    from worker.batches.run import run_batch

    queue.handlers.pop(TASK_BATCH)  # the worker that took it died before it beat its heartbeat
    upload = api.files.create(file=("r.jsonl", _chat("a", "hi")), purpose="batch")
    batch = api.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert resume_stale(worker_ctx) == []  # not silent for long enough yet
    with session_scope(worker_ctx.sessions) as session:
        session.get(Batch, batch.id).created_at = utcnow() - timedelta(seconds=settings.batch_stale_s + 1)
    assert resume_stale(worker_ctx) == [batch.id] and resume_stale(worker_ctx) == []  # claimed: sent once
    assert [args for name, args, _ in queue.sent if name == TASK_BATCH] == [[batch.id], [batch.id]]
    held = Lease(worker_ctx, batch.id)
    assert held.acquire()
    run_batch(worker_ctx, batch.id)  # a duplicate delivery while a runner holds the lease: nothing happens
    assert api.batches.retrieve(batch.id).request_counts.completed == 0
    held.release()
    run_batch(worker_ctx, batch.id)
    assert api.batches.retrieve(batch.id).status == "completed"


def test_a_refused_send_fails_the_batch_with_its_reason(api, client, served, queue):
    upload = api.files.create(file=("r.jsonl", _chat("a", "hi")), purpose="batch")
    queue.refuse = True
    answer = client.post("/v1/batches", json={"input_file_id": upload.id, "endpoint": "/v1/chat/completions"})
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "server_error"
    [batch] = api.batches.list().data
    assert batch.status == "failed" and batch.failed_at and batch.errors.data[0].code == "broker_unavailable"
