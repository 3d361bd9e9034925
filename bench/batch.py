"""Benchmark: /v1/batches against the interactive route, and what a running batch costs interactive latency.

One `trainserve up` on a model of `bench/generate.py`'s GPT-2 shape (`--layers`, random weights, eos suppressed so
every request gets exactly its tokens), fp32 on the CPU. Requests are /v1/completions bodies with SST-2 sentences
as prompts and `--max-tokens` greedy tokens each.

1. Throughput, `--requests` requests each way: the interactive route (`baseline`: non-streaming
   POST /v1/completions, `--concurrency` clients) and one batch of them (POST /v1/batches, polled every 0.2 s until
   completed). Tokens/s over the wall time of each; the ratio batch / interactive. The two sides send different
   sentences (the same count and token budget), so neither finds the other's prompts in the prefix cache.
2. Interactive latency: `--probes` closed-loop clients send short requests (`--probe-tokens` tokens) for
   `--seconds` s alone, and for `--seconds` s while a batch of `--batch-lines` lines runs (cancelled after, and
   waited for until it stops). p50 and p99 of their end-to-end latency, and the ratio with / without the batch.
Both run `--repeats` times with new sentences each time, the side going first alternating; medians [min-max] of
the repeats, the per-repeat ratios and the load average after each run; `--json` writes the bench/results record.
A batch holds at most `--batch-share` of the engine's `max_batch_size` rows while interactive requests are in the
engine (TRAINSERVE_BATCH_SHARE) and `--batch-idle-share` while none are (TRAINSERVE_BATCH_IDLE_SHARE); by default
that is `--concurrency` rows, so in 1. the batch decodes as many rows at once as the interactive clients.

`--embeddings`: the batches are /v1/embeddings lines (`minilm-l6`, one SST-2 sentence per line) instead. 1. compares
inputs/s of the same requests through the interactive /v1/embeddings route (`--concurrency` clients; the inference
worker) and as one batch (the generation worker); 2. runs the same generation probes beside an embeddings batch,
which gives way to them (it pauses to take TRAINSERVE_BATCH_SHARE of the time while they run).

    python bench/batch.py --json bench/results/batch-completions.json   # about 5 minutes on 2 cores
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
from datetime import date
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from bench.generate import build_model, free_port, spread, start_service  # noqa: E402
from bench.machine import describe, provenance  # noqa: E402
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


def interactive_rate(client: httpx.Client, args: argparse.Namespace, texts: list[str]) -> float:
    """Units (tokens generated, or inputs embedded) per second through the interactive route."""
    begun = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        if args.embeddings:
            list(pool.map(lambda t: embed(client, t), texts))
        else:
            list(pool.map(lambda t: complete(client, t, args.max_tokens), texts))
    return units(args) / (time.perf_counter() - begun)


def batch_rate(client: httpx.Client, args: argparse.Namespace, texts: list[str]) -> float:
    """Units per second of one batch of the texts, from its submission until it completed."""
    begun = time.perf_counter()
    done = wait_batch(client, submit_batch(client, texts, args.max_tokens, args.embeddings))
    seconds = time.perf_counter() - begun
    assert done["status"] == "completed" and done["request_counts"]["completed"] == args.requests, done
    return units(args) / seconds


def units(args: argparse.Namespace) -> int:
    return args.requests * (1 if args.embeddings else args.max_tokens)


def beside_batch(client: httpx.Client, args: argparse.Namespace, offset: int) -> tuple[list[float], int]:
    """The probes' latencies while a batch of --batch-lines lines runs, and the lines it completed meanwhile; the
    batch is cancelled after and waited for, so the next run starts on an idle engine."""
    batch_id = submit_batch(client, prompts(args.batch_lines, offset), args.max_tokens, args.embeddings)
    time.sleep(1.0)  # the batch is running
    latencies = probe(client, args, offset)
    during = client.get(f"/v1/batches/{batch_id}").json()
    client.post(f"/v1/batches/{batch_id}/cancel")
    wait_batch(client, batch_id)
    return latencies, int(during["request_counts"]["completed"])


def probe(client: httpx.Client, args: argparse.Namespace, offset: int) -> list[float]:
    """Closed-loop interactive clients for --seconds: every request's latency."""
    latencies: list[float] = []
    stop = time.monotonic() + args.seconds
    lock = threading.Lock()

    def loop(worker: int) -> None:
        n = 0
        while time.monotonic() < stop:
            seconds = complete(client, prompts(1, offset + worker * 97 + n)[0], args.probe_tokens)
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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the result here (bench/results format)")
    parser.add_argument("--target", default="", help="the target the result is judged against (written to --json)")
    args = parser.parse_args()
    if args.batch_idle_share is None:  # equal row budgets: the batch alone decodes as many rows as the clients
        args.batch_idle_share = min(1.0, args.concurrency / MAX_ROWS)
    rates: dict[str, list[float]] = {"interactive": [], "batch": []}
    latencies: dict[str, list[list[float]]] = {"alone": [], "beside": []}
    completed: list[int] = []
    loads: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        build_model(home / "models" / MODEL, args.layers)
        port = free_port()
        # The interactive side's clients are one tenant: its limits admit all of them (the baseline's best setting).
        proc = start_service(home, port, "fp32", TRAINSERVE_GENERATION_RATE_PER_MINUTE="1000000",
                             TRAINSERVE_INFERENCE_PER_TENANT=str(args.concurrency),
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
                # Every run sends sentences of its own: a prompt seen before would be served from the prefix cache.
                span = 2 * args.requests + args.batch_lines + args.probes * 97 + 1000
                for repeat in range(args.repeats):
                    offset = repeat * span
                    sides = [("interactive", interactive_rate, offset), ("batch", batch_rate, offset + args.requests)]
                    for name, rate, first in sides if repeat % 2 == 0 else reversed(sides):
                        rates[name].append(rate(client, args, prompts(args.requests, first)))
                        loads.append(os.getloadavg()[0])
                        print(f"repeat {repeat + 1} {name}: {rates[name][-1]:.1f} (load {loads[-1]:.2f})", flush=True)
                    probes = offset + 2 * args.requests
                    for name in ("alone", "beside") if repeat % 2 == 0 else ("beside", "alone"):
                        if name == "alone":
                            latencies[name].append(probe(client, args, probes))
                        else:
                            measured, lines = beside_batch(client, args, probes + args.probes * 97)
                            latencies[name].append(measured)
                            completed.append(lines)
                        loads.append(os.getloadavg()[0])
                        print(f"repeat {repeat + 1} probes {name}: p99 {pct(latencies[name][-1], 0.99) * 1000:.0f} ms"
                              f" (load {loads[-1]:.2f})", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    route, unit = ("/v1/embeddings", "inputs/s") if args.embeddings else ("/v1/completions", "tokens/s")
    ratios = [b / i for b, i in zip(rates["batch"], rates["interactive"], strict=True)]
    p50 = {name: [statistics.median(run) * 1000 for run in runs] for name, runs in latencies.items()}
    p99 = {name: [pct(run, 0.99) * 1000 for run in runs] for name, runs in latencies.items()}
    p99_ratios = [b / a for b, a in zip(p99["beside"], p99["alone"], strict=True)]
    lines = [
        f"batch {spread(rates['batch'])} vs interactive {spread(rates['interactive'])} {unit} "
        f"({args.concurrency} clients): {statistics.median(ratios):.2f}x (per repeat "
        f"{', '.join(f'{r:.2f}x' for r in ratios)})",
        f"interactive generation ({args.probes} clients x {args.probe_tokens} tokens) p50/p99 "
        f"{statistics.median(p50['alone']):.0f}/{statistics.median(p99['alone']):.0f} ms alone vs "
        f"{statistics.median(p50['beside']):.0f}/{statistics.median(p99['beside']):.0f} ms beside the batch: "
        f"p99 {statistics.median(p99_ratios):.2f}x (per repeat {', '.join(f'{r:.2f}x' for r in p99_ratios)}); "
        f"the batch completed {statistics.median(completed):.0f} of {args.batch_lines} lines in those "
        f"{args.seconds:.0f} s (median)",
    ]
    print(f"\nmodel: GPT-2 shape, {args.layers} layers, fp32 CPU; batch share {args.batch_share} beside interactive "
          f"requests, {args.batch_idle_share} alone; {route}; medians [min-max] of {args.repeats} repeats")
    for line in lines:
        print(line)
    print(f"load average {tuple(round(x, 2) for x in os.getloadavg())}")
    if args.json:
        what = (f"/v1/batches of {route} lines vs the interactive route, {args.requests} requests each way "
                + (f"(minilm-l6, {args.concurrency} clients)" if args.embeddings else
                   f"x {args.max_tokens} tokens ({args.layers}-layer GPT-2 shape, fp32, {args.concurrency} clients; "
                   f"the batch holds as many rows alone)")
                + f"; the p99 of {args.probes} closed-loop interactive generation clients for {args.seconds:.0f} s "
                f"without and with a {args.batch_lines}-line batch running; medians of {args.repeats} interleaved "
                "repeats, new sentences in every run")
        args.json.write_text(json.dumps({
            "benchmark": "bench/batch.py", "what": what, "command": "python bench/batch.py " + " ".join(sys.argv[1:]),
            "date": date.today().isoformat(), "machine": describe(), "load": f"{min(loads):.1f}-{max(loads):.1f}",
            "result": "; ".join(lines), "target": args.target, **provenance("bench/batch.py"),
        }, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
