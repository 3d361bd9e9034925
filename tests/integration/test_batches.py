"""/v1/batches against real processes (the API and the generation worker) with the official client: a batch
with a good and a bad line runs to completed; its output equals the interactive route's greedy answers and the
bad line is in the error file with its custom_id."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import openai
import pytest

from tests.conftest import INTEGRATION_REDIS, make_key
from tests.service import started_service

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]
CHATS = {"good-1": "What colour is the sky?", "good-2": "Name a fruit."}


def _line(custom_id: str, body: dict) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": body}).encode() + b"\n"


def test_a_batch_runs_on_the_workers_and_reports_its_bad_line(pg_url, tmp_path, tiny_llama_dir):
    home = tmp_path / "home"
    shutil.copytree(tiny_llama_dir, home / "models" / "tiny-llama")
    with started_service(pg_url, INTEGRATION_REDIS, home, tmp_path, TRAINSERVE_GENERATION_PRECISION="fp32") as base:
        api = openai.OpenAI(base_url=f"{base}/v1", api_key=make_key(pg_url, tenant="batches"), max_retries=0,
                            timeout=60)
        data = b"".join(_line(custom_id, {"model": "tiny-llama", "max_tokens": 8, "temperature": 0,
                                          "messages": [{"role": "user", "content": content}]})
                        for custom_id, content in CHATS.items())
        data += _line("bad", {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
                              "temperature": 7})
        upload = api.files.create(file=("requests.jsonl", data), purpose="batch")
        batch = api.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while (batch := api.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"batch {batch.id} still {batch.status}"
            time.sleep(0.5)
        assert batch.status == "completed", batch.errors
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 2, 1)
        output = [json.loads(line) for line in api.files.content(batch.output_file_id).read().splitlines()]
        [error] = [json.loads(line) for line in api.files.content(batch.error_file_id).read().splitlines()]
        assert error["custom_id"] == "bad" and error["response"]["status_code"] == 422
        assert error["response"]["body"]["error"]["param"] == "temperature"
        assert [line["custom_id"] for line in output] == list(CHATS)
        for line in output:
            interactive = api.chat.completions.create(
                model="tiny-llama", max_tokens=8, temperature=0,
                messages=[{"role": "user", "content": CHATS[line["custom_id"]]}])
            body = line["response"]["body"]
            assert body["choices"][0]["message"]["content"] == interactive.choices[0].message.content
            assert body["usage"]["completion_tokens"] == interactive.usage.completion_tokens


def test_a_sigkilled_generation_worker_resumes_the_batch_without_redoing_lines(tmp_path, tiny_llama_dir):
    from tests.integration.conftest import wait_for
    from tests.integration.test_local_mode import _processes, _up

    home = tmp_path / "home"
    shutil.copytree(tiny_llama_dir, home / "models" / "tiny-llama")
    proc, api = _up(home, tmp_path / "up.log", TRAINSERVE_BATCH_STALE_S="3", TRAINSERVE_BATCH_CHUNK_LINES="2",
                    TRAINSERVE_GENERATION_PRECISION="fp32")
    try:
        lines = 160
        data = b"".join(_line(f"r{i}", {"model": "tiny-llama", "max_tokens": 24, "temperature": 0,
                                        "messages": [{"role": "user", "content": f"Say {i}"}]}) for i in range(lines))
        upload = api.post("/v1/files", files={"file": ("r.jsonl", data)}, data={"purpose": "batch"}).json()
        batch_id = api.post("/v1/batches", json={"input_file_id": upload["id"], "endpoint": "/v1/chat/completions",
                                                 "completion_window": "24h"}).json()["id"]
        wait_for(lambda: api.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"] >= 6, 120,
                 "a few chunks done")
        [victim] = [pid for pid, parent, args in _processes() if parent == proc.pid and "--queues generation" in args]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        before = api.get(f"/v1/batches/{batch_id}").json()
        assert before["status"] == "in_progress" and before["request_counts"]["completed"] < lines, before
        done = wait_for(lambda: (b := api.get(f"/v1/batches/{batch_id}").json())["status"] == "completed" and b, 180,
                        "the batch to complete on the restarted worker")
        assert done["request_counts"] == {"total": lines, "completed": lines, "failed": 0}
        output = api.get(f"/v1/files/{done['output_file_id']}/content").text.splitlines()
        assert [json.loads(line)["custom_id"] for line in output] == [f"r{i}" for i in range(lines)]
        # Every chunk stored before the kill was kept as it was: the restarted worker never ran those lines again.
        parts = sorted((home / "batches" / batch_id).glob("part-*.json"))
        kept = [p for p in parts if int(p.stem.split("-")[1]) < before["request_counts"]["completed"]]
        assert kept and all(p.stat().st_mtime < killed_at for p in kept)
        assert "resuming at line" in (tmp_path / "up.log").read_text()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        api.close()
