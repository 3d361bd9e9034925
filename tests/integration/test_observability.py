"""Real processes: scrape the API's and the workers' /metrics during a running job and a generation burst, and
follow one request id from the API's JSON log lines through the broker into the training worker's."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import make_key
from tests.factories import job_body, sentiment_rows, tsv_bytes
from tests.integration.conftest import _free_port, wait_for
from tests.tiny_lm import build_tiny_gpt2

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REQUEST_ID = "trace-observability-1"


def _scrape(url: str) -> dict[str, float]:
    """Every sample as `name{k="v",...}` -> value."""
    text = httpx.get(url, timeout=10).text
    return {s.name + json.dumps(dict(sorted(s.labels.items())), separators=(",", ":")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict[str, float], name: str, **labels: str) -> float:
    return samples.get(name + json.dumps(dict(sorted(labels.items())), separators=(",", ":")), 0.0)


def _json_lines(path: Path) -> list[dict]:
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def test_metrics_during_a_job_and_a_burst_and_logs_that_follow_the_job(start_api, start_worker, worker_env, settings,
                                                                      tiny_bert_dir, tmp_path):
    build_tiny_gpt2(settings.home / "models" / "tiny")
    train_port, gen_port = _free_port(), _free_port()
    worker_env.update(TRAINSERVE_LOG_FORMAT="json", TRAINSERVE_GENERATION_QUEUE_PER_MODEL="3")
    start_worker("training", env={"TRAINSERVE_WORKER_METRICS_PORT": str(train_port)})
    start_worker("generation", env={"TRAINSERVE_WORKER_METRICS_PORT": str(gen_port)})
    api = start_api(TRAINSERVE_MODEL_ROOTS=str(tiny_bert_dir.parent))
    client = httpx.Client(base_url=api, timeout=240,  # a burst on a busy 2-core machine can take a minute or more
                          headers={"Authorization": f"Bearer {make_key(settings.resolved_database_url)}"})

    train = client.post("/datasets", files={"file": ("t.tsv", tsv_bytes(sentiment_rows(4)))}).json()["id"]
    body = job_body(train, base_model=str(tiny_bert_dir),
                    hyperparameters={"max_steps": 100_000, "batch_size": 8, "max_length": 16, "precision": "fp32"})
    response = client.post("/jobs", json=body, headers={"X-Request-ID": REQUEST_ID})
    assert response.status_code == 201, response.text
    assert response.headers["x-request-id"] == REQUEST_ID
    job_id = response.json()["id"]
    wait_for(lambda: client.get(f"/jobs/{job_id}").json()["progress"]["step"] >= 3, 240, "the job to take steps")

    # A burst past the per-model bound while the job trains: some 429s, the rest answered.
    peak_in_flight = 0.0
    bursting = threading.Event()

    def watch() -> None:
        nonlocal peak_in_flight
        while not bursting.is_set():
            in_flight = _value(_scrape(f"http://127.0.0.1:{gen_port}/metrics"),
                               "trainserve_generation_requests_in_flight")
            peak_in_flight = max(peak_in_flight, in_flight)
            bursting.wait(0.25)  # scraping in a tight loop would starve the worker it watches

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with ThreadPoolExecutor(max_workers=10) as pool:
        codes = list(pool.map(lambda i: client.post("/generate", json={
            "model": "tiny", "prompt": f"Line {i}:", "max_new_tokens": 16, "temperature": 0.7, "seed": i,
        }).status_code, range(10)))
    bursting.set()
    watcher.join(10)
    assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes

    api_metrics = _scrape(f"{api}/metrics")
    assert _value(api_metrics, "trainserve_jobs", status="running") == 1
    assert _value(api_metrics, "trainserve_http_rate_limited_total", route="/generate") == codes.count(429)
    assert _value(api_metrics, "trainserve_http_request_duration_seconds_count", method="POST",
                  route="/generate") == len(codes)
    training = _scrape(f"http://127.0.0.1:{train_port}/metrics")
    assert _value(training, "trainserve_worker_jobs_running") == 1
    assert _value(training, "trainserve_training_samples_per_second", device="cpu") > 0
    assert _value(training, "trainserve_training_step_seconds_count", device="cpu") > 0
    assert _value(training, "trainserve_training_steps_total", device="cpu") >= 3
    assert _value(training, "trainserve_device_memory_bytes", device="cpu") > 0
    assert _value(training, "trainserve_job_queue_wait_seconds_count", task="text-classification") == 1
    generation = _scrape(f"http://127.0.0.1:{gen_port}/metrics")
    assert _value(generation, "trainserve_generation_requests_total", outcome="done") == codes.count(200)
    assert _value(generation, "trainserve_generation_tokens_total") > 0
    assert _value(generation, "trainserve_generation_time_to_first_token_seconds_count") == codes.count(200)
    assert _value(generation, "trainserve_generation_inter_token_latency_seconds_count") > 0
    assert _value(generation, "trainserve_generation_batch_size_count") > 0
    assert _value(generation, "trainserve_generation_batch_size_sum") > \
        _value(generation, "trainserve_generation_batch_size_count")  # some steps decoded several requests
    assert peak_in_flight >= 1
    # The warm engine's state, read at the scrape: its KV cache by part, running and waiting work, draft tokens.
    kv_parts = {json.loads(key[key.index("{"):])["part"] for key in generation
                if key.startswith("trainserve_generation_kv_cache_bytes{")}
    assert kv_parts == {"pool", "used", "prefix"}, kv_parts
    assert any(key.startswith("trainserve_generation_sequences_running{") for key in generation)
    assert any(key.startswith("trainserve_generation_draft_tokens_total{") for key in generation)

    assert client.post(f"/jobs/{job_id}/cancel").status_code == 200
    job = wait_for(lambda: (j := client.get(f"/jobs/{job_id}").json())["status"] == "cancelled" and j, 60,
                   "the job to stop")
    assert "tensorboard" in [a["kind"] for a in job["artifacts"]]
    wait_for(lambda: _value(_scrape(f"http://127.0.0.1:{train_port}/metrics"), "trainserve_job_duration_seconds_count",
                            task="text-classification", status="cancelled") == 1, 10, "the job's duration")

    # The API's line for the job and the worker's lines for it share the request id.
    api_lines = [e for e in _json_lines(tmp_path / "api.log") if e.get("request_id") == REQUEST_ID]
    assert any(e.get("job_id") == job_id and "created" in e["message"] for e in api_lines), api_lines
    worker_lines = [e for e in _json_lines(tmp_path / "worker-training-0.log") if e.get("job_id") == job_id]
    assert worker_lines and all(e.get("request_id") == REQUEST_ID for e in worker_lines), worker_lines
    assert any("claimed" in e["message"] for e in worker_lines) and any("ended" in e["message"] for e in worker_lines)
