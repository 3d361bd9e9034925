"""Benchmark: trainserve against the servers a user would pick instead, on one real chat model.

The model is SmolLM2-135M-Instruct (`make smollm2`: an HF folder, fp32). The sides, all streaming OpenAI chat
completions, greedy, on the same weights:
- `trainserve`: the whole service (`trainserve up`: API, Celery over Redis, the continuous batcher), fp32;
- `trainserve-vllm`: the same service with vLLM as its engine (TRAINSERVE_GENERATION_ENGINE=vllm: the worker starts
  vLLM's server from `make vllm`'s environment and keeps admission and the tenant share itself), fp32;
- `vllm`: vLLM's own OpenAI server (its CPU build, `make vllm`) on the same folder, fp32, `--max-num-seqs --slots`
  (the engine's rows, 32: `max_batch_size`),
  prefix caching on (its default), eager unless `--vllm-compile` (its compile warm-up takes minutes here), one
  engine thread bound per core and none reserved (`VLLM_CPU_OMP_THREADS_BIND=0,1,...`,
  `VLLM_CPU_NUM_OF_RESERVED_CPU=0`: its `auto` binding keeps a core of 2 for its API server;
  bench/vllm_cpu_settings.py compares these settings); no LoRA (`--enable-lora` costs it tokens/s on a CPU);
- `llama-f32`, `llama-f16`, `llama-q8_0`, `llama-q4_k_m`: llama.cpp's own `llama-server` (`make llama-server`) on
  GGUFs of the same folder at those precisions (f32, f16 and Q8_0 written by llama.cpp's converter, Q4_K_M by
  `llama-quantize`), continuous batching with `--slots` parallel slots (as many as the engine's rows), one thread
  per core, each pinned to its core (`--cpu-strict 1`), its KV cache f16 (its default);
- `hf-serve`: `transformers serve` (plain: one `generate` per request, in a thread), fp32;
- `hf-serve-cb`: `transformers serve --continuous_batching` (where it runs: in transformers 4.57 its cache sizing
  reads GPU memory and it fails on a CPU; a side that fails to start is reported, not dropped silently).

Load (`--mode`):
- `poisson` (default): one seeded Poisson trace per `--rates` value, `--requests` chats each: a user message (an
  instruction about an SST-2 sentence), `--min-tokens`..`--max-tokens` new tokens at most (chats may end earlier
  on `<|im_end|>`); `--shared-system` puts one 300-600 token system prompt in front of every chat;
- `closed`: `--concurrency` streams (16 by default), each sending the next chat of the trace as soon as its last
  one ended, until `--requests` are done: tokens/s at that concurrency.

Every answer is re-tokenized with the HF tokenizer, so tokens are counted the same way on every side, whatever a
server reports or however it groups tokens into stream chunks. Per run: tokens/s (tokens over first send to last
end), TTFT (first non-empty chunk), ITL (per request, (end - first chunk) / (tokens - 1)), end-to-end latency
p50/p90/p99, goodput (requests/s with TTFT <= `--slo-ttft` and ITL <= `--slo-itl`) and the requests refused (429)
or failed. A refused or failed request has infinite latency in the percentiles (so p99 reads `inf` once more
than 1% are refused) and misses the SLO. Every server starts first and is warmed up; then each repeat runs each
side once, one side at a time, the order rotated per repeat, every other server stopped (SIGSTOP) meanwhile: a
server's idle polling or unfinished work cannot take a core from the side being measured (each side answers a
short warm-up chat after it is continued, before its run). Printed: every run, then per side the median with
[min-max] over the repeats, the ratios to trainserve, how many greedy answers of each side equal trainserve's
(first repeat), and the load average over the runs; `--json PATH` writes the summary in bench/results/'s format.

    python bench/peers.py --sides trainserve,vllm,llama-f32,hf-serve --rates 1 2 --requests 60 --repeats 3
    python bench/peers.py --mode closed --concurrency 16 --sides trainserve,vllm,llama-f32,llama-q4_k_m --requests 64
    python bench/peers.py --requests 3 --rates 2 --min-tokens 4 --max-tokens 8 --repeats 1 --sides trainserve,llama-f32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from bench.generate import children, free_port, served_precision, start_service  # noqa: E402
from bench.machine import describe, provenance  # noqa: E402
from core.settings import Settings  # noqa: E402
from trainserve.real_models import SMOLLM2_DIR, build_smollm2  # noqa: E402

SST2 = ROOT / "examples" / "data" / "sst2_train_4k.tsv"
SHAKESPEARE = ROOT / "examples" / "data" / "tinyshakespeare_sample.txt"
LLAMA_CACHE = Path.home() / ".cache" / "trainserve" / "llama.cpp"
INSTRUCTIONS = (
    "Is this movie review positive or negative? Explain why: \"{s}\"",
    "Rewrite this sentence in formal English: \"{s}\"",
    "Write a short story that begins with: \"{s}\"",
    "Summarize in one sentence what the critic thinks: \"{s}\"",
    "List three questions a reader might ask about: \"{s}\"",
)
# llama.cpp's sides: the GGUF precision each serves (bench/build_llama_server.sh writes them).
LLAMA_PRECISIONS = {"llama-f32": "f32", "llama-f16": "f16", "llama-q8_0": "q8_0", "llama-q4_k_m": "q4_k_m"}
ALL_SIDES = ("trainserve", "trainserve-vllm", "vllm", *LLAMA_PRECISIONS, "hf-serve", "hf-serve-cb")
Row = dict[str, Any]


@dataclass
class Side:
    """A started server: where to post chats, as which model, and the process to stop."""

    name: str
    base: str
    model: str
    proc: subprocess.Popen[bytes]
    headers: dict[str, str] = field(default_factory=dict)
    stop: Callable[[], None] | None = None
    note: str = ""  # how it runs other than its defaults, and why (the record says it)

    def processes(self) -> list[int]:
        """The server's process and every process under it (`trainserve up`'s API and workers, their children)."""
        under = children()
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo += under.get(pid, [])
        return found

    def pause(self) -> None:
        """Stop the server's processes (SIGSTOP) while another side is measured: nothing it still runs or polls
        takes a core from that side."""
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def close(self) -> None:
        self.resume()  # a stopped process would not act on the signal that ends it
        if self.stop is not None:
            self.stop()
        elif self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# --- The trace ---

def trace(args: argparse.Namespace, tokenizer: Any, rate: float) -> list[Row]:
    """The seeded chats of one trace: arrival (s from the start), messages, max_tokens."""
    rng = random.Random(f"{args.seed}-{rate}-{args.shared_system}")
    sentences = [line.split("\t")[0].strip() for line in SST2.read_text().splitlines()[1:] if line.strip()]
    system: list[dict[str, str]] = []
    if args.shared_system:  # one 300-600 token system prompt shared by every chat of the trace
        ids = tokenizer(" ".join(SHAKESPEARE.read_text().split()[:1500]))["input_ids"][:rng.randint(300, 600)]
        system = [{"role": "system", "content": "You are a helpful assistant who has read this play:\n"
                   + tokenizer.decode(ids)}]
    at, chats = 0.0, []
    for _ in range(args.requests):
        at += rng.expovariate(rate)
        user = rng.choice(INSTRUCTIONS).format(s=rng.choice(sentences))
        chats.append({"at": at, "messages": [*system, {"role": "user", "content": user}],
                      "max_tokens": rng.randint(args.min_tokens, args.max_tokens)})
    return chats


# --- One chat, a replay ---

async def chat(client: httpx.AsyncClient, side: Side, request: Row) -> Row:
    """Stream one chat completion; times are from its send."""
    body = {"model": side.model, "messages": request["messages"], "max_tokens": request["max_tokens"],
            "temperature": 0, "stream": True}
    sent = time.perf_counter()
    first, parts, status, error = None, [], 200, ""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=side.headers,
                                 timeout=1800) as response:
            status = response.status_code
            if status != 200:
                error = (await response.aread()).decode(errors="replace")[:300]
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    event = json.loads(line.removeprefix("data:"))
                    if "error" in event:
                        status, error = 500, json.dumps(event["error"])[:300]
                        break
                    for choice in event.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content") or ""
                        if text:
                            first = time.perf_counter() - sent if first is None else first
                            parts.append(text)
    except httpx.HTTPError as exc:
        status, error = 599, repr(exc)  # the connection failed: counted as failed, like a 5xx
    return {"sent": sent, "end": time.perf_counter(), "ttft": first, "text": "".join(parts), "status": status,
            "error": error}


async def replay(side: Side, requests: list[Row], concurrency: int | None) -> list[Row]:
    """Open loop (each chat at its arrival time) or closed loop (`concurrency` streams back to back)."""
    # A connection per chat, on every side: a kept-alive connection the server has just closed (llama-server's
    # keep-alive ends after a few seconds) would fail the next chat sent on it before it reached the server.
    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=side.base, limits=limits) as client:
        start = time.perf_counter()
        if concurrency is None:
            async def at_arrival(request: Row) -> Row:
                await asyncio.sleep(max(0.0, start + request["at"] - time.perf_counter()))
                return await chat(client, side, request)
            return list(await asyncio.gather(*(at_arrival(r) for r in requests)))
        pending = list(reversed(range(len(requests))))
        done: list[Row] = [{} for _ in requests]  # in trace order, as the open loop's

        async def stream() -> None:
            while pending:
                index = pending.pop()
                done[index] = await chat(client, side, requests[index])
        await asyncio.gather(*(stream() for _ in range(concurrency)))
        return done


# --- Figures ---

def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else math.nan


def summarize(results: list[Row], tokenizer: Any, args: argparse.Namespace) -> Row:
    """The figures of one run; answers re-tokenized with the HF tokenizer (no special tokens)."""
    span = max(r["end"] for r in results) - min(r["sent"] for r in results)
    ok = [r for r in results if r["status"] == 200]
    for r in results:
        r["tokens"] = len(tokenizer(r["text"], add_special_tokens=False)["input_ids"]) if r["status"] == 200 else 0
        decode = r["end"] - r["sent"] - (r["ttft"] or 0.0)
        r["itl"] = decode / (r["tokens"] - 1) if r["tokens"] > 1 else 0.0
    inf = math.inf  # refused and failed requests: infinite latency, never dropped from the percentiles

    def meets(r: Row) -> bool:
        return r["status"] == 200 and r["ttft"] is not None and r["ttft"] <= args.slo_ttft and r["itl"] <= args.slo_itl

    ttft = [r["ttft"] if r["status"] == 200 and r["ttft"] is not None else inf for r in results]
    itl = [r["itl"] if r["status"] == 200 else inf for r in results]
    e2e = [r["end"] - r["sent"] if r["status"] == 200 else inf for r in results]
    return {"tokens_per_s": sum(r["tokens"] for r in results) / span, "tokens": sum(r["tokens"] for r in results),
            "goodput": sum(map(meets, results)) / span, "requests": len(results),
            "refused": sum(r["status"] in (429, 503) for r in results),
            "failed": sum(r["status"] not in (200, 429, 503) for r in results), "served": len(ok),
            **{f"ttft_p{q}": pct(ttft, q / 100) for q in (50, 90, 99)},
            **{f"itl_p{q}": pct(itl, q / 100) for q in (50, 90, 99)},
            **{f"e2e_p{q}": pct(e2e, q / 100) for q in (50, 90, 99)}, "load": os.getloadavg()[0]}


def spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    """`median [min-max]`."""
    med, low, high = (scale * v for v in (statistics.median(values), min(values), max(values)))
    return f"{med:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"


KEYS = (("tokens_per_s", "tokens/s", 1, 1), ("goodput", "goodput/s", 1, 2), ("ttft_p50", "TTFT p50 s", 1, 2),
        ("ttft_p90", "TTFT p90 s", 1, 2), ("itl_p50", "ITL p50 ms", 1000, 0), ("itl_p99", "ITL p99 ms", 1000, 0),
        ("e2e_p50", "e2e p50 s", 1, 1), ("e2e_p90", "e2e p90 s", 1, 1), ("e2e_p99", "e2e p99 s", 1, 1),
        ("refused", "refused", 1, 0), ("failed", "failed", 1, 0))


def report(rows: dict[tuple[str, str], list[Row]]) -> list[str]:
    """Lines: per load and side the medians [min-max], then each side against trainserve."""
    lines = []
    for (load, side), runs in rows.items():
        figures = ", ".join(f"{label} {spread([run[key] for run in runs], scale, digits)}"
                            for key, label, scale, digits in KEYS)
        lines.append(f"{load} {side}: {figures}")
    for load in dict.fromkeys(load for load, _ in rows):
        ours = rows.get((load, "trainserve"))
        for (other_load, side), runs in rows.items():
            if other_load != load or side == "trainserve" or not ours:
                continue
            median = {key: statistics.median(run[key] for run in runs) for key in ("tokens_per_s", "e2e_p90")}
            mine = {key: statistics.median(run[key] for run in ours) for key in ("tokens_per_s", "e2e_p90")}
            throughput = mine["tokens_per_s"] / median["tokens_per_s"] if median["tokens_per_s"] else math.inf
            p90 = mine["e2e_p90"] / median["e2e_p90"] if median["e2e_p90"] else math.nan
            lines.append(f"{load}: trainserve / {side}: {throughput:.2f}x tokens/s at {p90:.2f}x its p90 end-to-end "
                         f"({mine['e2e_p90']:.1f} vs {median['e2e_p90']:.1f} s)")
    return lines


def agreement(answers: dict[tuple[str, str], list[str | None]]) -> list[str]:
    """Per load and side: how many greedy answers equal trainserve's (same weights; llama.cpp's kernels and f16 KV
    cache may round differently, so a few answers can part after some tokens)."""
    lines = []
    for (load, side), texts in answers.items():
        ours = answers.get((load, "trainserve"))
        if side == "trainserve" or ours is None:
            continue
        both = [(a, b) for a, b in zip(ours, texts, strict=True) if a is not None and b is not None]
        lines.append(f"{load}: {side} answered as trainserve in {sum(a == b for a, b in both)} of {len(both)} chats")
    return lines


# --- The servers ---

def wait_ready(proc: subprocess.Popen[bytes], url: str, seconds: float, log: Path) -> None:
    """Return once GET `url` answers 200; raise naming the log when the process exits or time runs out."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"not ready after {seconds:.0f} s; see {log}")


def cores() -> int:
    """How many cores this process may run on (its affinity, which every server started from here inherits): each
    server's threads. All of them, unless a caller kept some for itself (bench/guidellm_load.py keeps its client's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def start_trainserve(name: str, folder: Path, home: Path, args: argparse.Namespace) -> Side:
    """`trainserve up` on a fresh home, serving `folder` (fp32) as <home>/models/<its name> (a link); the side
    `trainserve-vllm` with vLLM as its engine (eager unless --vllm-compile, as the vllm side)."""
    (home / "models").mkdir(parents=True, exist_ok=True)
    (home / "models" / folder.name).symlink_to(folder.resolve(), target_is_directory=True)
    port = free_port()
    engine = {"TRAINSERVE_GENERATION_ENGINE": "vllm", "TRAINSERVE_MAX_BATCH_SIZE": str(args.slots),
              "TRAINSERVE_VLLM_ENFORCE_EAGER": str(not args.vllm_compile).lower(),
              "TRAINSERVE_VLLM_STARTUP_S": "900"} if name == "trainserve-vllm" else {}
    proc = start_service(home, port, "fp32", **engine)
    key = (home / "admin.key").read_text().strip()

    def stop() -> None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
    return Side(name, f"http://127.0.0.1:{port}", folder.name, proc, {"Authorization": f"Bearer {key}"}, stop)


def start_vllm(name: str, folder: Path, home: Path, args: argparse.Namespace) -> Side:
    """vLLM's own OpenAI server from `make vllm`'s environment: fp32, --slots sequences, its default threads."""
    from worker.engines.vllm.server import INSTALL_HINT, cpu_list, find_python

    python = find_python()
    if python is None:
        raise RuntimeError(INSTALL_HINT)
    port, log = free_port(), home / f"{name}.log"
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name",
               folder.name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-num-seqs", str(args.slots), "--max-model-len", str(args.slot_context * 4),
               "--disable-uvicorn-access-log", *([] if args.vllm_compile else ["--enforce-eager"])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cores()), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "OMP_NUM_THREADS": str(cores())}
    env.pop("PYTHONPATH", None)
    proc = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    wait_ready(proc, f"http://127.0.0.1:{port}/health", 900, log)
    return Side(name, f"http://127.0.0.1:{port}", folder.name, proc)


def start_llama(name: str, gguf: Path, home: Path, args: argparse.Namespace) -> Side:
    """llama-server: continuous batching, `--slots` slots of `--slot-context` positions each, one thread a core,
    each pinned to its core."""
    if not gguf.is_file():
        raise RuntimeError(f"no GGUF at {gguf}: run `make llama-server`")
    port, log = free_port(), home / f"{name}.log"
    threads = str(cores())
    command = [str(args.llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(args.slots), "-c", str(args.slots * args.slot_context), "--cont-batching",
               "-t", threads, "-tb", threads, "--cpu-strict", "1", "--cpu-strict-batch", "1", "--no-webui"]
    proc = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/health", 300, log)
        return Side(name, f"http://127.0.0.1:{port}", gguf.stem, proc)
    except RuntimeError:
        if proc.returncode != -signal.SIGSEGV:
            raise
    # Its repacked weight layouts for quantized types (AMX or AVX-512 kernels) crash some machines at start (seen on
    # an AMX Xeon VM): the same server without repacking, said in the record, rather than no figure.
    proc = subprocess.Popen([*command, "--no-repack"], stdout=log.open("ab"), stderr=subprocess.STDOUT)
    wait_ready(proc, f"http://127.0.0.1:{port}/health", 300, log)
    return Side(name, f"http://127.0.0.1:{port}", gguf.stem, proc,
                note=f"{name} without weight repacking (--no-repack): with it, llama-server crashed at start here "
                     "(SIGSEGV as its thread pool started)")


def start_hf_serve(name: str, folder: Path, home: Path) -> Side:
    """`transformers serve` on the CPU in fp32, forced to `folder`; `hf-serve-cb` with --continuous_batching."""
    port, log = free_port(), home / f"{name}.log"
    command = [sys.executable, "-m", "transformers.commands.transformers_cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--device", "cpu", "--dtype", "float32", "--force-model", str(folder)]
    if name == "hf-serve-cb":
        command.append("--continuous_batching")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    wait_ready(proc, f"http://127.0.0.1:{port}/health", 300, log)
    return Side(name, f"http://127.0.0.1:{port}", str(folder), proc)


def start(name: str, folder: Path, home: Path, args: argparse.Namespace) -> Side:
    if name in ("trainserve", "trainserve-vllm"):
        return start_trainserve(name, folder, home / name, args)
    if name == "vllm":
        return start_vllm(name, folder, home, args)
    if name in LLAMA_PRECISIONS:
        return start_llama(name, args.ggufs / f"{folder.name}-{LLAMA_PRECISIONS[name]}.gguf", home, args)
    return start_hf_serve(name, folder, home)


def last_error(log: Path) -> str:
    """`; <the log's last line naming an error>`, or nothing: why a side failed, kept after its log is gone."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    found = [line.strip() for line in lines if "Error" in line or "error:" in line]
    return f"; {found[-1][:300]}" if found else ""


def warm(side: Side) -> None:
    """Load the model (the service's worker loads it on the first request) and run one short chat; a side whose
    warm-up fails raises."""
    request = {"at": 0.0, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    for attempt in range(5):
        result = asyncio.run(replay(side, [request], None))[0]
        if result["status"] == 200 and result["text"]:
            return
        time.sleep(2 * (attempt + 1))
    why = result["error"] or "an empty answer"
    raise RuntimeError(f"the warm-up chat failed with status {result['status']}: {why}")


def start_sides(names: list[str], folder: Path, home: Path,
                args: argparse.Namespace) -> tuple[dict[str, Side], dict[str, str]]:
    """Start and warm each side in `home` (a temporary folder), each then paused (SIGSTOP) until it is measured;
    returns the started sides and why each other one did not start (printed as it fails)."""
    (home / "trainserve").mkdir(exist_ok=True)
    sides: dict[str, Side] = {}
    failed: dict[str, str] = {}
    try:
        for name in names:
            try:
                sides[name] = start(name, folder, home, args)
                warm(sides[name])
            except (RuntimeError, OSError) as exc:
                failed[name] = f"{exc}{last_error(home / f'{name}.log')}"
                print(f"{name}: did not start: {failed[name]}", flush=True)
                if name in sides:
                    sides.pop(name).close()
    except BaseException:
        for side in sides.values():
            side.close()
        raise
    if "trainserve" in sides:
        print(f"trainserve precision: {served_precision(home / 'trainserve')}", flush=True)
    for side in sides.values():
        side.pause()
    return sides, failed


# --- The result file ---

def peer_versions(args: argparse.Namespace) -> str:
    """The version of each peer among the sides (llama-server's build, vLLM's package), e.g. "llama-server b6100
    (a1b2c3d), vLLM 0.32.0"; a peer whose version cannot be read is named as unknown."""
    found = []
    if any(name in LLAMA_PRECISIONS for name in args.sides):
        try:
            out = subprocess.run([str(args.llama_server), "--version"], capture_output=True, text=True, timeout=60)
            line = next((x for x in (out.stdout + out.stderr).splitlines() if x.startswith("version:")), "")
            found.append(f"llama-server {line.removeprefix('version:').strip() or 'unknown'}")
        except OSError:
            found.append("llama-server unknown")
    if any(name in ("vllm", "trainserve-vllm") for name in args.sides):
        from worker.engines.vllm.server import find_python

        python = find_python()
        package = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                                 capture_output=True, text=True, timeout=120) if python else None
        found.append(f"vLLM {package.stdout.strip() if package is not None and package.returncode == 0 else 'unknown'}")
    return ", ".join(found)


def result_json(args: argparse.Namespace, rows: dict[tuple[str, str], list[Row]], lines: list[str],
                failed_sides: dict[str, str], side_notes: list[str] | None = None) -> dict[str, Any]:
    """bench/results/'s format (trainserve.docs_reference.BenchmarkResult)."""
    loads = [run["load"] for runs in rows.values() for run in runs]
    load_mode = (f"closed loop, {args.concurrency} concurrent streams" if args.mode == "closed"
                 else f"seeded Poisson traces at {', '.join(f'{r:g}' for r in args.rates)} requests/s")
    vllm_note = (f"; vLLM (both vllm sides) --max-num-seqs {args.slots}, "
                 f"{'compiled' if args.vllm_compile else 'eager'}, one engine thread bound per core, no LoRA"
                 if any("vllm" in side for side in args.sides) else "")
    llama = [LLAMA_PRECISIONS[name] for name in args.sides if name in LLAMA_PRECISIONS]
    versions = peer_versions(args)
    ggufs = f" ({'/'.join(llama)} GGUFs for llama.cpp)" if llama else ""
    what = (f"SmolLM2-135M-Instruct fp32{ggufs}, "
            f"streamed greedy chats, {load_mode}, "
            f"{args.requests} chats of {args.min_tokens}-{args.max_tokens} new tokens"
            f"{', one shared 300-600 token system prompt' if args.shared_system else ''}; sides "
            f"{', '.join(args.sides)}{f' ({versions})' if versions else ''}"
            f"{f'; llama-server -np {args.slots}, one thread pinned per core' if llama else ''}{vllm_note}; "
            "tokens re-tokenized with the "
            "HF tokenizer; "
            f"medians [min-max] of {args.repeats} interleaved repeats")
    notes = [*(side_notes or []), *(f"{name} did not run: {why}" for name, why in failed_sides.items())]
    return {"benchmark": "bench/peers.py", "what": what, "command": "python bench/peers.py " + " ".join(sys.argv[1:]),
            "date": datetime.now(UTC).strftime("%Y-%m-%d"), "machine": describe(),
            "load": f"{min(loads):.1f}-{max(loads):.1f}" if loads else "not recorded",
            "result": "; ".join(lines + notes), "target": args.target, **provenance("bench/peers.py")}


# --- Main ---

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", type=lambda v: [s.strip() for s in v.split(",") if s.strip()],
                        default=["trainserve", "llama-f32", "hf-serve"],
                        help=f"comma-separated, of {', '.join(ALL_SIDES)}")
    parser.add_argument("--mode", choices=("poisson", "closed"), default="poisson")
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0], help="poisson: requests/s per trace")
    parser.add_argument("--concurrency", type=int, default=16, help="closed: concurrent streams")
    parser.add_argument("--requests", type=int, default=60, help="chats per trace")
    parser.add_argument("--min-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--shared-system", action="store_true", help="one 300-600 token system prompt on every chat")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of every side")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="goodput: first token within this many s")
    parser.add_argument("--slo-itl", type=float, default=0.25, help="goodput: inter-token latency, s")
    parser.add_argument("--model", type=Path, default=SMOLLM2_DIR, help="the HF folder (built when missing)")
    parser.add_argument("--ggufs", type=Path, default=LLAMA_CACHE, help="the folder of the llama sides' GGUFs, "
                        "<model folder name>-<precision>.gguf (bench/build_llama_server.sh's)")
    parser.add_argument("--llama-server", type=Path, default=LLAMA_CACHE / "bin" / "llama-server")
    parser.add_argument("--slots", type=int, default=Settings().max_batch_size,
                        help="llama-server's parallel slots (-np) and vLLM's --max-num-seqs (default: the engine's "
                        "rows, max_batch_size)")
    parser.add_argument("--slot-context", type=int, default=2048, help="llama-server's positions per slot")
    parser.add_argument("--vllm-compile", action="store_true", help="vLLM with torch.compile (minutes of warm-up "
                        "here) instead of eager, on both vLLM sides")
    parser.add_argument("--json", type=Path, help="write the summary here (bench/results/'s format)")
    parser.add_argument("--target", default="", help="the target the result is checked against (the JSON's)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.sides) - set(ALL_SIDES))
    if unknown:
        parser.error(f"unknown sides {unknown}; choose from {', '.join(ALL_SIDES)}")
    if not 1 <= args.min_tokens <= args.max_tokens:
        parser.error(f"--min-tokens ({args.min_tokens}) must be between 1 and --max-tokens ({args.max_tokens})")
    return args


def main(argv: list[str] | None = None) -> int:
    """Start every side, warm it, run the loads side by side (rotated per repeat), print and write the figures."""
    args = parse_args(argv)
    from transformers import AutoTokenizer

    folder = build_smollm2(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    loads = ([(f"closed c={args.concurrency}", trace(args, tokenizer, 1.0))] if args.mode == "closed"
             else [(f"rate {rate:g}/s", trace(args, tokenizer, rate)) for rate in args.rates])
    print(f"{os.cpu_count()} CPUs; {folder}; sides {args.sides}; {args.mode}; {args.requests} chats, "
          f"{args.min_tokens}-{args.max_tokens} new tokens, shared system {args.shared_system}, seed {args.seed}, "
          f"{args.repeats} repeats; load before {os.getloadavg()[0]:.1f}", flush=True)
    rows: dict[tuple[str, str], list[Row]] = {}
    answers: dict[tuple[str, str], list[str | None]] = {}  # each side's first run: greedy answers to compare
    with tempfile.TemporaryDirectory(prefix="trainserve-peers-") as tmp:
        home = Path(tmp)
        sides, failed_sides = start_sides(args.sides, folder, home, args)
        try:
            side_notes = [side.note for side in sides.values() if side.note]
            for note in side_notes:
                print(note, flush=True)
            concurrency = args.concurrency if args.mode == "closed" else None
            for repeat in range(args.repeats):
                names = list(sides)
                order = names[repeat % len(names):] + names[:repeat % len(names)] if names else []
                for load, requests in loads:
                    for name in order:
                        sides[name].resume()  # the only server running while it is measured
                        warm(sides[name])  # answering again (its workers' heartbeats caught up) before the clock
                        results = asyncio.run(replay(sides[name], requests, concurrency))
                        sides[name].pause()
                        answers.setdefault((load, name), [r["text"] if r["status"] == 200 else None for r in results])
                        run = summarize(results, tokenizer, args)
                        rows.setdefault((load, name), []).append(run)
                        print(f"repeat {repeat} {load} {name}: {run['tokens_per_s']:.1f} tokens/s, TTFT p50 "
                              f"{run['ttft_p50']:.2f} s, e2e p90 {run['e2e_p90']:.1f} s, refused {run['refused']}, "
                              f"failed {run['failed']}, load {run['load']:.1f}", flush=True)
        finally:
            for side in sides.values():
                side.close()
    names = [load for load, _ in loads]
    rows = {key: rows[key] for key in sorted(rows, key=lambda k: (names.index(k[0]), args.sides.index(k[1])))}
    lines = report(rows) + agreement(answers)
    print("\n" + "\n".join(lines))
    for name, why in failed_sides.items():
        print(f"{name} did not run: {why}")
    if args.json is not None:
        args.json.write_text(json.dumps(result_json(args, rows, lines, failed_sides, side_notes), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
