"""Benchmark: /v1/batches against the interactive route, and what a running batch costs interactive latency.

One `trainserve up` on a model of `bench/generate.py`'s GPT-2 shape (`--layers`, random weights, eos suppressed so
every request gets exactly its tokens), fp32 on the CPU. Requests are /v1/completions bodies with SST-2 sentences
as prompts and `--max-tokens` greedy tokens each.

1. Throughput, the same `--requests` requests both ways: the interactive route (`baseline`: non-streaming
   POST /v1/completions, `--concurrency` clients) and one batch of them (POST /v1/batches, polled every 0.2 s until
   completed). Tokens/s over the wall time of each; the ratio batch / interactive.
2. Interactive latency: `--probes` closed-loop clients send short requests (`--probe-tokens` tokens) for
   `--seconds` s, first alone, then while a batch of `--batch-lines` lines runs (cancelled after). p50 and p99 of
   their end-to-end latency, and the ratio with / without the batch.
A batch holds at most `--batch-share` of the engine's `max_batch_size` rows while interactive requests are in the
engine (TRAINSERVE_BATCH_SHARE) and `--batch-idle-share` while none are (TRAINSERVE_BATCH_IDLE_SHARE); by default
that is `--concurrency` rows, so in 1. the batch decodes as many rows at once as the interactive clients.

`--embeddings`: the batches are /v1/embeddings lines (`minilm-l6`, one SST-2 sentence per line) instead. 1. compares
inputs/s of the same requests through the interactive /v1/embeddings route (`--concurrency` clients; the inference
worker) and as one batch (the generation worker); 2. runs the same generation probes beside an embeddings batch,
which gives way to them (it pauses to take TRAINSERVE_BATCH_SHARE of the time while they run).

    python bench/batch.py                                          # about 2 minutes on 2 cores
    python bench/batch.py --batch-share 1 --batch-idle-share 1     # no fair share: a batch may take every row
    python bench/batch.py --embeddings --requests 512 --batch-lines 4000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from bench.generate import build_model, free_port, start_service  # noqa: E402
from core.settings import Settings  # noqa: E402

SST2 = ROOT / "examples" / "data" / "sst2_train_4k.tsv"
MODEL = "bench"
EMBEDDER = "minilm-l6"
MAX_ROWS: int = Settings.model_fields["max_batch_size"].default  # the engine's rows (the service's default)


def prompts(count: int, offset: int = 0) -> list[str]:
    rows = [line.split("\t")[0] for line in SST2.read_text().splitlines()[1:] if line.strip()]
    return [rows[(offset + i) % len(rows)] for i in range(count)]


def body(prompt: str, tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0}


def complete(client: httpx.Client, prompt: str, tokens: int) -> float:
    """One interactive request; its end-to-end seconds."""
    begun = time.perf_counter()
    answer = client.post("/v1/completions", json=body(prompt, tokens), timeout=600)
    answer.raise_for_status()
    assert answer.json()["usage"]["completion_tokens"] == tokens
    return time.perf_counter() - begun


def embed(client: httpx.Client, text: str) -> float:
    """One interactive /v1/embeddings request; its end-to-end seconds."""
    begun = time.perf_counter()
    answer = client.post("/v1/embeddings", json={"model": EMBEDDER, "input": text}, timeout=600)
    answer.raise_for_status()
    assert len(answer.json()["data"]) == 1
    return time.perf_counter() - begun


def submit_batch(client: httpx.Client, texts: list[str], tokens: int, embeddings: bool = False) -> str:
    url = "/v1/embeddings" if embeddings else "/v1/completions"
    bodies = [{"model": EMBEDDER, "input": text} if embeddings else body(text, tokens) for text in texts]
    lines = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": b}).encode() + b"\n"
                     for i, b in enumerate(bodies))
    upload = client.post("/v1/files", files={"file": ("b.jsonl", lines)}, data={"purpose": "batch"})
    upload.raise_for_status()
    batch = client.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": url,
                                             "completion_window": "24h"})
    batch.raise_for_status()
    return str(batch.json()["id"])


def wait_batch(client: httpx.Client, batch_id: str) -> dict:
    while True:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            return dict(batch)
        time.sleep(0.2)


def throughput(client: httpx.Client, args: argparse.Namespace) -> dict[str, float]:
    """Units (tokens generated, or inputs embedded) per second both ways."""
    texts = prompts(args.requests)
    begun = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        if args.embeddings:
            list(pool.map(lambda t: embed(client, t), texts))
        else:
            list(pool.map(lambda t: complete(client, t, args.max_tokens), texts))
    interactive = time.perf_counter() - begun
    begun = time.perf_counter()
    done = wait_batch(client, submit_batch(client, texts, args.max_tokens, args.embeddings))
    batch = time.perf_counter() - begun
    assert done["status"] == "completed" and done["request_counts"]["completed"] == args.requests, done
    units = args.requests * (1 if args.embeddings else args.max_tokens)
    return {"interactive": units / interactive, "batch": units / batch}


def probe(client: httpx.Client, args: argparse.Namespace) -> list[float]:
    """Closed-loop interactive clients for --seconds: every request's latency."""
    latencies: list[float] = []
    stop = time.monotonic() + args.seconds
    lock = threading.Lock()

    def loop(worker: int) -> None:
        n = 0
        while time.monotonic() < stop:
            seconds = complete(client, prompts(1, 1000 + worker * 97 + n)[0], args.probe_tokens)
            with lock:
                latencies.append(seconds)
            n += 1

    threads = [threading.Thread(target=loop, args=(w,)) for w in range(args.probes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64, help="requests of the throughput comparison")
    parser.add_argument("--concurrency", type=int, default=16, help="interactive clients of the throughput side")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--probes", type=int, default=2, help="interactive clients of the latency measurement")
    parser.add_argument("--probe-tokens", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each latency measurement")
    parser.add_argument("--batch-lines", type=int, default=400, help="lines of the batch running under the probes")
    parser.add_argument("--chunk-lines", type=int, default=64, help="TRAINSERVE_BATCH_CHUNK_LINES")
    parser.add_argument("--batch-share", type=float, default=0.125, help="rows held beside interactive requests")
    parser.add_argument("--batch-idle-share", type=float, default=None,
                        help="rows filled while the engine is idle (default: --concurrency of max_batch_size rows, "
                             "the interactive side's budget)")
    parser.add_argument("--embeddings", action="store_true", help="batches of /v1/embeddings lines (minilm-l6)")
    args = parser.parse_args()
    if args.batch_idle_share is None:  # equal row budgets: the batch alone decodes as many rows as the clients
        args.batch_idle_share = min(1.0, args.concurrency / MAX_ROWS)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        build_model(home / "models" / MODEL, args.layers)
        port = free_port()
        proc = start_service(home, port, "fp32", TRAINSERVE_GENERATION_RATE_PER_MINUTE="1000000",
                             TRAINSERVE_BATCH_SHARE=str(args.batch_share),
                             TRAINSERVE_BATCH_IDLE_SHARE=str(args.batch_idle_share),
                             TRAINSERVE_BATCH_CHUNK_LINES=str(args.chunk_lines))
        try:
            key = (home / "admin.key").read_text().strip()
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"},
                              timeout=600, limits=httpx.Limits(max_connections=64)) as client:
                complete(client, "warm up", 4)  # loads the model
                if args.embeddings:  # loads the encoder on the inference worker and on the generation worker
                    embed(client, "warm up")
                    wait_batch(client, submit_batch(client, ["warm up"], 0, embeddings=True))
                rates = throughput(client, args)
                alone = probe(client, args)
                batch_id = submit_batch(client, prompts(args.batch_lines, 2000), args.max_tokens, args.embeddings)
                time.sleep(1.0)  # the batch is running
                loaded = probe(client, args)
                during = client.get(f"/v1/batches/{batch_id}").json()
                client.post(f"/v1/batches/{batch_id}/cancel")
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"model: GPT-2 shape, {args.layers} layers, fp32 CPU; batch share {args.batch_share} beside interactive "
          f"requests, {args.batch_idle_share} alone")
    route, unit = ("/v1/embeddings", "inputs/s") if args.embeddings else ("/v1/completions", "tok/s")
    print(f"throughput, {args.requests} requests" + ("" if args.embeddings else f" x {args.max_tokens} tokens") + ":")
    print(f"  interactive {route} ({args.concurrency} clients), baseline: {rates['interactive']:.1f} {unit}")
    print(f"  /v1/batches: {rates['batch']:.1f} {unit}  ratio batch/interactive "
          f"{rates['batch'] / rates['interactive']:.2f}")
    print(f"interactive latency, {args.probes} clients x {args.probe_tokens} tokens, {args.seconds:.0f} s each:")
    for name, values in (("without a batch", alone), ("with a batch running", loaded)):
        print(f"  {name}: n={len(values)} p50 {statistics.median(values) * 1000:.0f} ms "
              f"p99 {pct(values, 0.99) * 1000:.0f} ms")
    print(f"  p99 ratio with/without: {pct(loaded, 0.99) / pct(alone, 0.99):.2f}; the batch ({route}) did "
          f"{during['request_counts']['completed']} of {args.batch_lines} lines meanwhile")
    print(f"load average {tuple(round(x, 2) for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
