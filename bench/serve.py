"""Benchmark: replay seeded traces of real traffic against `trainserve up` and against a static-batching server.

Traffic as it arrives at a service: Poisson arrivals at each `--rates` requests/s, `--requests` requests per trace,
prompts drawn from SST-2 sentences (`examples/data/sst2_train_4k.tsv`), each asking for a number of new tokens
drawn uniformly from `--min-tokens`..`--max-tokens`, greedy; all from `--seed`. With `--chat`, every prompt starts
with one shared system prompt of 300-600 tokens (Shakespeare, length drawn from the seed), as chat traffic does.
Sides, on the same model (`bench/generate.py`'s GPT-2-small shape or `--arch llama`, random weights, eos
suppressed so every request gets exactly its tokens) and precision (`--precision`, fp32 by default):
- `static` (the baseline): `bench/static_server.py`, HF `generate` with static batching (up to 32 requests,
  the service's max_batch_size; 20 ms wait), streaming each row's tokens as its batch produces them;
- `trainserve`: the whole service (`trainserve up`: API, Celery over Redis, the continuous batcher), streaming.
Both servers start first and are warmed up; then each trace runs on one side, then the other (the first side
alternating per repeat), so only one side works at a time. Per side and rate: tokens/s over the trace (tokens
over first arrival to last end), time to first token, inter-token latency and end-to-end latency p50/p90/p99,
and goodput: requests/s meeting the SLO (TTFT <= `--slo-ttft` s and mean inter-token latency <= `--slo-itl` s).
Medians over `--repeats`; the load average as each trace ended; the ratios trainserve / static. Requests the
service refuses with 429 (past `TRAINSERVE_GENERATION_QUEUE_PER_MODEL` in flight) are counted as `refused`: they
miss the SLO and count as infinite latency in the percentiles, so p99 reads `inf` once more than 1% are refused
(the static server never refuses; it queues).

    python bench/serve.py                                   # GPT-2 small, 1.5 and 4 requests/s, 80 requests
    python bench/serve.py --chat --rates 1                  # shared system prompt
    python bench/serve.py --layers 2 --requests 12 --rates 4 --repeats 1 --max-tokens 24   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from bench.generate import build_model, free_port, served_precision, start_service, wait_healthy  # noqa: E402

SST2 = ROOT / "examples" / "data" / "sst2_train_4k.tsv"
SHAKESPEARE = ROOT / "examples" / "data" / "tinyshakespeare_sample.txt"


def trace(args: argparse.Namespace, rate: float, tokenizer) -> list[dict]:
    """The seeded requests of one rate: arrival time (s from the start), prompt, tokens asked for."""
    rng = random.Random(f"{args.seed}-{rate}")
    sentences = [line.split("\t")[0] for line in SST2.read_text().splitlines()[1:] if line.strip()]
    system = ""
    if args.chat:  # one shared system prompt of 300-600 tokens for the whole trace
        words = SHAKESPEARE.read_text().split()
        length = rng.randint(300, 600)
        ids = tokenizer(" ".join(words[:1500]))["input_ids"][:length]
        system = "System: " + tokenizer.decode(ids) + "\n\nUser: "
    at, requests = 0.0, []
    for _ in range(args.requests):
        at += rng.expovariate(rate)
        requests.append({"at": at, "prompt": system + rng.choice(sentences),
                         "max_tokens": rng.randint(args.min_tokens, args.max_tokens)})
    return requests


async def one(client: httpx.AsyncClient, side: str, model: str, request: dict, start: float) -> dict:
    """Send one request at its arrival time and stream it; the times are from its arrival."""
    await asyncio.sleep(max(0.0, start + request["at"] - time.perf_counter()))
    sent = time.perf_counter()
    if side == "static":
        body = {"prompt": request["prompt"], "max_tokens": request["max_tokens"]}
    else:
        body = {"model": model, "prompt": request["prompt"], "max_new_tokens": request["max_tokens"],
                "temperature": 0, "stream": True}
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", "/generate", json=body, timeout=1200) as response:
        if response.status_code == 429:  # backpressure: counted as refused (a real client would retry later)
            return {"sent": sent, "end": time.perf_counter(), "e2e": 0.0, "times": [], "tokens": 0, "refused": True}
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if side == "static":
                if "token" in event:
                    times.append(time.perf_counter() - sent)
                tokens = event.get("completion_tokens", tokens)
            else:
                if "text" in event and "usage" not in event:
                    times.append(time.perf_counter() - sent)
                if "usage" in event:
                    tokens = event["usage"]["completion_tokens"]
    return {"sent": sent, "end": time.perf_counter(), "e2e": time.perf_counter() - sent, "times": times,
            "tokens": tokens, "refused": False}


async def replay(base: str, headers: dict, side: str, model: str, requests: list[dict]) -> list[dict]:
    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=len(requests) + 4)
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits) as client:
        start = time.perf_counter()
        return await asyncio.gather(*(one(client, side, model, r, start) for r in requests))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")


def summarize(results: list[dict], args: argparse.Namespace) -> dict:
    """Throughput, latency percentiles and goodput of one replayed trace; a refused request (429) misses the SLO
    and has infinite latency in the percentiles (never dropped from them)."""
    span = max(r["end"] for r in results) - min(r["sent"] for r in results)
    served = [r for r in results if not r["refused"]]
    refused = [math.inf] * (len(results) - len(served))
    ttft = [r["times"][0] for r in served if r["times"]] + refused
    itl = [b - a for r in served for a, b in zip(r["times"], r["times"][1:], strict=False)] + refused
    e2e = [r["e2e"] for r in served] + refused

    def meets(r: dict) -> bool:
        gaps = len(r["times"]) - 1
        mean_itl = (r["times"][-1] - r["times"][0]) / gaps if gaps > 0 else 0.0
        return bool(r["times"]) and r["times"][0] <= args.slo_ttft and mean_itl <= args.slo_itl

    return {"tokens_per_s": sum(r["tokens"] for r in results) / span, "tokens": sum(r["tokens"] for r in results),
            "goodput": sum(map(meets, results)) / span, "met": sum(map(meets, results)),
            "refused": len(results) - len(served),
            **{f"ttft_p{q}": pct(ttft, q / 100) for q in (50, 90, 99)},
            **{f"itl_p{q}": pct(itl, q / 100) for q in (50, 90, 99)},
            **{f"e2e_p{q}": pct(e2e, q / 100) for q in (50, 90, 99)}, "load": os.getloadavg()[0]}


def start_static(folder: Path, port: int, precision: str, home: Path) -> subprocess.Popen[bytes]:
    log = open(home / "static.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "static_server.py"), "--model", str(folder),
                             "--port", str(port), "--dtype", precision], stdout=log, stderr=subprocess.STDOUT)
    return wait_healthy(proc, port, 120, home / "static.log")


def medians(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def print_table(rows: dict, args: argparse.Namespace) -> None:
    """One line per rate and side (medians over the repeats), then trainserve against static per rate."""
    print(f"\n{'rate':>5} {'side':<11}{'tokens/s':>9}{'goodput':>9}{'TTFT p50/p90/p99 s':>22}"
          f"{'ITL p50/p99 ms':>16}{'e2e p50/p90/p99 s':>22}{'refused':>8}{'load':>6}")
    for (rate, side), runs in rows.items():
        m = medians(runs)
        ttft = "/".join(f"{m[k]:.2f}" for k in ("ttft_p50", "ttft_p90", "ttft_p99"))
        itl = "/".join(f"{1000 * m[k]:.0f}" for k in ("itl_p50", "itl_p99"))
        e2e = "/".join(f"{m[k]:.1f}" for k in ("e2e_p50", "e2e_p90", "e2e_p99"))
        print(f"{rate:>5g} {side:<11}{m['tokens_per_s']:>9.1f}{m['goodput']:>9.2f}{ttft:>22}{itl:>16}{e2e:>22}"
              f"{m['refused']:>8g}{m['load']:>6.1f}")
    for rate in args.rates:
        static, ours = medians(rows[(rate, "static")]), medians(rows[(rate, "trainserve")])
        print(f"rate {rate:g}/s: trainserve / static {ours['tokens_per_s'] / static['tokens_per_s']:.2f}x tokens/s; "
              f"p90 end-to-end {ours['e2e_p90']:.1f} vs {static['e2e_p90']:.1f} s "
              f"({static['e2e_p90'] / ours['e2e_p90']:.1f}x lower); TTFT p50 {ours['ttft_p50']:.2f} vs "
              f"{static['ttft_p50']:.2f} s, ITL p99 {1000 * ours['itl_p99']:.0f} vs {1000 * static['itl_p99']:.0f} ms; "
              f"goodput {ours['goodput']:.2f} vs {static['goodput']:.2f} requests/s")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[1.5, 4.0], help="requests/s of the traces")
    parser.add_argument("--requests", type=int, default=80, help="requests per trace")
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--chat", action="store_true", help="a shared 300-600 token system prompt on every request")
    parser.add_argument("--arch", default="gpt2", choices=("gpt2", "llama"))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="both sides' precision")
    parser.add_argument("--repeats", type=int, default=1, help="traces per side and rate (medians)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="goodput: first token within this many s")
    parser.add_argument("--slo-itl", type=float, default=0.25, help="goodput: mean inter-token latency, s")
    return parser.parse_args()


def main() -> None:
    """Build the model, start both servers, warm them, replay every trace on each side in turn, print."""
    args = parse_args()
    print(f"{os.cpu_count()} CPUs; {args.arch} shape, {args.layers} layers, {args.precision}; rates {args.rates}, "
          f"{args.requests} requests each, {args.min_tokens}-{args.max_tokens} new tokens, chat {args.chat}, "
          f"seed {args.seed}, {args.repeats} repeats; load before {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="trainserve-serve-") as tmp:
        home = Path(tmp)
        name = f"{args.arch}-bench"
        folder = home / "models" / name
        build_model(folder, args.layers, args.arch)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        static_port, port = free_port(), free_port()
        static = start_static(folder, static_port, args.precision, home)
        service = start_service(home, port, args.precision)
        try:
            key = (home / "admin.key").read_text().strip()
            bases = {"static": (f"http://127.0.0.1:{static_port}", {}),
                     "trainserve": (f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"})}
            warm = [{"at": 0.0, "prompt": "warm up", "max_tokens": 4}]
            for side, (base, headers) in bases.items():  # loads the model (the service's worker does it lazily)
                for attempt in range(5):
                    try:
                        asyncio.run(replay(base, headers, side, name, warm))
                        break
                    except httpx.HTTPStatusError:
                        if attempt == 4:
                            raise
            print(f"service precision: {served_precision(home)}", flush=True)
            rows: dict[tuple[float, str], list[dict]] = {}
            for rate in args.rates:
                requests = trace(args, rate, tokenizer)
                for repeat in range(args.repeats):
                    order = ["static", "trainserve"] if repeat % 2 == 0 else ["trainserve", "static"]
                    for side in order:
                        base, headers = bases[side]
                        result = summarize(asyncio.run(replay(base, headers, side, name, requests)), args)
                        rows.setdefault((rate, side), []).append(result)
                        print(f"rate {rate:g} {side}: {result['tokens_per_s']:.1f} tokens/s, e2e p90 "
                              f"{result['e2e_p90']:.1f} s, load {result['load']:.1f}", flush=True)
            rows = {key: rows[key] for key in sorted(rows, key=lambda k: (k[0], k[1] != "static"))}
            print_table(rows, args)
        finally:
            static.kill()
            service.send_signal(signal.SIGINT)
            service.wait(120)


if __name__ == "__main__":
    main()
