"""Benchmark: guidellm, a load generator no one here wrote, runs the same profiles against trainserve and each peer.

guidellm (PyPI `guidellm`, `make guidellm`: its own environment under ~/.cache/trainserve) measures every side
through the same OpenAI-compatible route, so no figure depends on a client this project wrote. The sides are those
of bench/peers.py (its `ALL_SIDES`: trainserve, vLLM, llama-server at four precisions, transformers serve, on
SmolLM2-135M-Instruct), started, warmed, paused and closed by peers.py's own code with its settings (`--slots`,
`--slot-context`, `--vllm-compile`, `--llama-server`, `--ggufs`, `--model` are passed to its parser).

Each side runs the same guidellm scenario per profile (`--profiles`, all three by default; one `guidellm run` each):
- `synchronous`: one request at a time;
- `poisson`: seeded Poisson arrivals at each `--rates` value, one benchmark per rate;
- `sweep`: guidellm's own sweep: synchronous, then throughput (`--max-concurrency` requests at once, by default
  the engine's rows as peers.py's `--slots`), then `--sweep-size` - 2 Poisson rates spread evenly up to the
  throughput it measured (so each side's sweep rates are its own; the offered rate is printed beside them).
Every request is a streamed chat completion (`/v1/chat/completions`, temperature 0) of guidellm's synthetic text:
`--prompt-tokens` in and exactly `--output-tokens` out (guidellm sends `max_completion_tokens` with `ignore_eos`,
which every side honours), sized by SmolLM2's own tokenizer folder as guidellm's processor, seeded. Each benchmark
stops at `--max-seconds` or `--max-requests`, whichever comes first, the same on every side; requests still running
then are counted as incomplete, not as errors.

Every server starts first and answers a warm-up chat; then each repeat runs each side once, the order rotated per
repeat, every other server stopped with SIGSTOP meanwhile (as peers.py does), the side answering a warm-up chat
again before each profile. Where the machine has 4 cores or more, guidellm runs on the last core alone (`taskset`)
and the servers on the others (each sizes its threads from the cores it may use); on fewer cores they share all
cores and the record says the client is not pinned. guidellm runs `--client-processes` worker processes (1: one
asyncio process keeps dozens of streams). Printed: every benchmark, then per profile point and side the
median with [min-max] over the repeats of the figures as guidellm's own tables report them (requests/s and output
tokens/s over all requests: the mean rate over the benchmark's window; TTFT, ITL, TPOT and end-to-end latency p50
and p90 of completed requests; errored and incomplete requests), each side against trainserve (the median and
[min-max] of the per-repeat ratios), and the load average. `--json PATH` writes the record in bench/results/'s
format; `--reports DIR` keeps guidellm's own JSON reports.

How guidellm's figures differ from peers.py's (so the two can disagree without either being wrong):
- tokens: guidellm counts what the server reports (`usage.completion_tokens`, asked for with
  `stream_options.include_usage`; without it, one token per streamed chunk); peers.py re-tokenizes each answer
  with the HF tokenizer. With `ignore_eos` and a fixed count both see the same N tokens a request.
- TTFT: both from the request's send to the first chunk with content; guidellm starts its clock at the first
  header write, peers.py before it opens the connection.
- ITL: guidellm per request (last content chunk - first content chunk) / (tokens - 1), and its percentiles are
  weighted by each request's tokens - 1 (a percentile over tokens); peers.py per request (end of the response -
  first chunk) / (tokens - 1), where the end includes the usage chunk and `[DONE]`, percentiles over requests.
- TPOT (guidellm only): (last content chunk - the request's start) / tokens, so it includes TTFT; percentiles
  weighted by tokens.
- throughput: guidellm the mean rate over its measured window (a request cut off at the end counts the chunks it
  got); peers.py all tokens over first send to last end. guidellm's load is synthetic text of fixed lengths;
  peers.py's are SST-2 instructions whose answers may end early on `<|im_end|>`.
- refusals: guidellm counts a refused (429) or failed request as an error and leaves it out of its latency
  percentiles; peers.py keeps it in them as infinite latency.
A sweep whose throughput benchmark completes no request within the budget is stopped by guidellm itself (it has no
rate to sweep to); that run is reported as failed, and the side's other profiles still count.

    python bench/guidellm_load.py --sides trainserve,vllm,llama-q8_0 --rates 1 2 --repeats 3
    python bench/guidellm_load.py --sides trainserve,vllm,llama-q8_0 --profiles poisson sweep --rates 2 \
        --sweep-size 3 --max-seconds 10 --output-tokens 32 --json bench/results/guidellm-load.json
    python bench/guidellm_load.py --sides trainserve --repeats 1 --rates 1 --sweep-size 3 --max-concurrency 8 \
        --max-seconds 10 --prompt-tokens 64 --output-tokens 16   # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from bench import peers  # noqa: E402
from bench.machine import describe, provenance  # noqa: E402
from trainserve.real_models import build_smollm2  # noqa: E402

GUIDELLM = Path.home() / ".cache" / "trainserve" / "guidellm" / "bin" / "guidellm"
PROFILES = ("synchronous", "poisson", "sweep")
# bench/peers.py's options that start the servers; every other option of its parser is its own load's.
SERVER_OPTIONS = ("--model", "--ggufs", "--llama-server", "--slots", "--slot-context", "--vllm-compile")
Row = dict[str, Any]
# (key, label, digits): what `figures()` reads of a benchmark, as guidellm's own tables print it.
FIGURES = (("requests_per_s", "req/s", 2), ("output_tokens_per_s", "output tok/s", 1),
           ("ttft_p50", "TTFT p50 ms", 0), ("ttft_p90", "TTFT p90 ms", 0), ("itl_p50", "ITL p50 ms", 1),
           ("itl_p90", "ITL p90 ms", 1), ("tpot_p50", "TPOT p50 ms", 1), ("tpot_p90", "TPOT p90 ms", 1),
           ("e2e_p50", "e2e p50 s", 2), ("e2e_p90", "e2e p90 s", 2), ("errored", "errors", 0),
           ("incomplete", "incomplete", 0))
# (key, label, better): the ratios to trainserve, trainserve's figure over the side's.
RATIOS = (("output_tokens_per_s", "output tok/s", "higher"), ("ttft_p50", "TTFT p50", "lower"),
          ("itl_p50", "ITL p50", "lower"), ("e2e_p90", "e2e p90", "lower"))


# --- The scenario guidellm runs ---

def scenario(args: argparse.Namespace, side: peers.Side, profile: str, folder: Path, report: Path) -> Row:
    """guidellm's scenario file (`guidellm run --scenario`) for one profile against one side."""
    shapes: dict[str, Row] = {
        "synchronous": {"kind": "synchronous"},
        "poisson": {"kind": "poisson", "rate": args.rates},
        "sweep": {"kind": "sweep", "sweep_size": args.sweep_size, "strategy_type": "poisson",
                  "max_concurrency": args.max_concurrency},
    }
    key = side.headers.get("Authorization", "").removeprefix("Bearer ") or None
    return {"metadata": {"labels": {"side": side.name, "profile": profile}}, "spec": {
        "backend": {"kind": "openai_http", "target": side.base, "model": side.model,
                    "request_format": "/v1/chat/completions", "api_key": key, "stream": True,
                    "extras": {"body": {"temperature": 0}}},
        "profile": shapes[profile],
        "constraints": [{"kind": "max_duration", "seconds": args.max_seconds},
                        {"kind": "max_requests", "count": args.max_requests}],
        "data": [{"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens,
                  "output_tokens": args.output_tokens}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(folder)},
        "seed": {"kind": "static", "value": args.seed},
        "outputs": [{"kind": "json", "path": str(report)}],
        # Every request's timings stay in the figures; only the prompts and answers are left out of the report.
        "metrics": {"kind": "generative", "sample_size": 0},
    }}


def placement(cores: list[int]) -> tuple[int | None, list[int]]:
    """guidellm's own core and the servers' cores: the last core alone where there are 4 or more, else no core of
    its own (it shares them all: one core of 2 or 3 would take too much from the servers)."""
    if len(cores) >= 4:
        return cores[-1], cores[:-1]
    return None, cores


def run_guidellm(scenario_file: Path, log: Path, client_core: int | None, processes: int) -> Row:
    """Run guidellm on a scenario with `processes` worker processes (pinned to `client_core` where given) and
    return its JSON report."""
    command = [str(GUIDELLM), "run", "--scenario", str(scenario_file), "--disable-console-interactive"]
    if client_core is not None:
        command = ["taskset", "-c", str(client_core), *command]
    # The scenario alone configures it: no GUIDELLM__* setting of this shell, and not this checkout's packages.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUIDELLM__") and k != "PYTHONPATH"}
    # Its worker processes are a setting, not the scenario's. Each one it spawns imports torch and transformers
    # again, and one asyncio process keeps dozens of streams; its default, 10, cost 13 s more CPU a run on 2 cores
    # and queued hundreds of Poisson requests ahead that its report then counts as incomplete.
    env.update(HF_HUB_OFFLINE="1", GUIDELLM__MAX_WORKER_PROCESSES=str(processes))
    report = json.loads(scenario_file.read_text())["spec"]["outputs"][0]["path"]
    Path(report).unlink(missing_ok=True)  # never an earlier run's
    with log.open("wb") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0 or not Path(report).is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"guidellm exited with {done.returncode}: {' | '.join(tail)}")
    return dict(json.loads(Path(report).read_text()))


def guidellm_version() -> str:
    """The installed guidellm's version, e.g. "0.8.1"; raises naming `make guidellm` where it is missing."""
    if not GUIDELLM.is_file():
        raise SystemExit(f"no guidellm at {GUIDELLM}: run `make guidellm`")
    out = subprocess.run([str(GUIDELLM), "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().rsplit(" ", 1)[-1]


# --- Reading guidellm's report ---

def label(profile: str, index: int, benchmark: Row) -> str:
    """The profile point a benchmark measured: `synchronous`, `poisson 2/s`, `sweep 3 poisson`."""
    strategy = benchmark["config"]["strategy"]
    if profile == "poisson":
        return f"poisson {strategy['rate']:g}/s"
    if profile == "sweep":
        return f"sweep {index + 1} {strategy['type_']}"
    return profile


def figures(benchmark: Row) -> Row:
    """One benchmark of guidellm's report as the figures its own tables print: rates over all requests (their mean
    over the benchmark's window), latencies of completed requests (ms, end-to-end in s)."""
    metrics = benchmark["metrics"]
    done = metrics["request_totals"]["successful"]

    def completed(name: str, q: str) -> float:
        # guidellm reports 0 for a distribution with no values: no request completed is no latency at all.
        return float(metrics[name]["successful"]["percentiles"][q]) if done else math.nan

    strategy = benchmark["config"]["strategy"]
    return {"requests_per_s": metrics["requests_per_second"]["total"]["mean"],
            "output_tokens_per_s": metrics["output_tokens_per_second"]["total"]["mean"],
            **{f"{key}_{q}": completed(name, q) for key, name in (
                ("ttft", "time_to_first_token_ms"), ("itl", "inter_token_latency_ms"),
                ("tpot", "time_per_output_token_ms"), ("e2e", "request_latency")) for q in ("p50", "p90")},
            "completed": done, "errored": metrics["request_totals"]["errored"],
            "incomplete": metrics["request_totals"]["incomplete"], "offered": strategy.get("rate"),
            "seconds": benchmark["duration"]}


def benchmarks(profile: str, report: Row) -> Iterator[tuple[str, Row]]:
    """(point, figures) of every benchmark in one guidellm report."""
    for index, benchmark in enumerate(report["benchmarks"]):
        yield label(profile, index, benchmark), figures(benchmark)


# --- The summary ---

def spread(values: Sequence[float | None], digits: int) -> str:
    """peers.py's `median [min-max]` over the repeats that have the figure; `n/a` where none has (no request
    completed)."""
    found = [value for value in values if value is not None and math.isfinite(value)]
    return peers.spread(found, digits=digits) if found else "n/a"


def table(rows: dict[tuple[str, str], list[Row]]) -> list[str]:
    """Per point and side, each figure's median [min-max] over the repeats (and the offered rate where the
    strategy had one)."""
    lines = []
    for (point, side), runs in rows.items():
        offered = [run["offered"] for run in runs]
        shown = [f"{name} {spread([run[key] for run in runs], digits)}" for key, name, digits in FIGURES]
        if any(rate is not None for rate in offered):
            shown.insert(0, f"offered req/s {spread(offered, 2)}")
        lines.append(f"{point} {side}: {', '.join(shown)}")
    return lines


def ratios(rows: dict[tuple[str, str], list[Row]]) -> list[str]:
    """Per point, trainserve's figures over each side's, repeat by repeat (the sides of a repeat ran back to back),
    as the median [min-max] of those ratios."""
    lines = []
    for (point, side), runs in rows.items():
        ours = rows.get((point, "trainserve"))
        if side == "trainserve" or not ours:
            continue
        mine_by_repeat = {run["repeat"]: run for run in ours}
        pairs = [(mine_by_repeat[run["repeat"]], run) for run in runs if run["repeat"] in mine_by_repeat]
        shown = []
        for key, name, better in RATIOS:
            each = [mine[key] / theirs[key] for mine, theirs in pairs
                    if theirs[key] and math.isfinite(mine[key] / theirs[key])]
            if each:
                shown.append(f"{name} {spread(each, 2)}x ({better} is better)")
        lines.append(f"{point}: trainserve / {side}: {', '.join(shown) if shown else 'no figures to compare'}")
    return lines


def result_json(args: argparse.Namespace, servers: argparse.Namespace, version: str,
                cores: tuple[int | None, list[int]], lines: list[str], failures: list[str], loads: list[float]) -> Row:
    """bench/results/'s format (trainserve.docs_reference.BenchmarkResult)."""
    llama = [peers.LLAMA_PRECISIONS[name] for name in args.sides if name in peers.LLAMA_PRECISIONS]
    versions = peers.peer_versions(servers)
    said = {"synchronous": "synchronous",
            "poisson": f"Poisson at {', '.join(f'{r:g}' for r in args.rates)} requests/s",
            "sweep": f"a sweep of {args.sweep_size} (synchronous, throughput at {args.max_concurrency} concurrent, "
                     "then Poisson rates up to that throughput)"}
    profiles = [said[profile] for profile in args.profiles]
    client_core, server_cores = cores
    pinning = (f"guidellm pinned to core {client_core} (taskset), the servers on the other {len(server_cores)}"
               if client_core is not None else f"guidellm not pinned: it shares the {len(server_cores)} cores with "
               "the server measured (fewer than 4)")
    ggufs = f" ({'/'.join(llama)} GGUFs for llama.cpp)" if llama else ""
    what = (f"guidellm {version} against each side on SmolLM2-135M-Instruct fp32{ggufs}: sides {', '.join(args.sides)}"
            f"{f' ({versions})' if versions else ''}; profiles {'; '.join(profiles)}; streamed chat completions at "
            f"temperature 0 of guidellm's synthetic text, {args.prompt_tokens} prompt tokens and exactly "
            f"{args.output_tokens} output tokens (ignore_eos) by SmolLM2's tokenizer, seed {args.seed}; each "
            f"benchmark at most {args.max_seconds:g} s or {args.max_requests} requests on every side; peers.py's "
            f"servers (--slots {servers.slots}); {pinning}, {args.client_processes} guidellm worker "
            f"process{'es' if args.client_processes > 1 else ''}; figures as guidellm reports them (rates over all "
            f"requests, latency percentiles of completed requests, ITL and TPOT weighted by tokens); medians "
            f"[min-max] of {args.repeats} interleaved repeats")
    return {"benchmark": "bench/guidellm_load.py", "what": what,
            "command": "python bench/guidellm_load.py " + " ".join(sys.argv[1:]),
            "date": datetime.now(UTC).strftime("%Y-%m-%d"), "machine": describe(),
            "load": f"{min(loads):.1f}-{max(loads):.1f}" if loads else "not recorded",
            "result": "; ".join(lines + failures), "target": args.target, **provenance("bench/guidellm_load.py")}


# --- Main ---

def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """This script's options, and bench/peers.py's namespace for starting the servers (its SERVER_OPTIONS)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"bench/peers.py's server options are passed to its parser: {', '.join(SERVER_OPTIONS)}")
    parser.add_argument("--sides", type=lambda v: [s.strip() for s in v.split(",") if s.strip()],
                        default=["trainserve", "vllm", "llama-q8_0"],
                        help=f"comma-separated, of {', '.join(peers.ALL_SIDES)}")
    parser.add_argument("--profiles", nargs="+", choices=PROFILES, default=list(PROFILES))
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0], help="poisson: requests/s")
    parser.add_argument("--sweep-size", type=int, default=4, help="sweep: benchmarks, at least 3 (synchronous, "
                        "throughput, then Poisson rates)")
    parser.add_argument("--max-concurrency", type=int, help="sweep: requests at once in its throughput benchmark "
                        "and at most in its Poisson ones (default: peers.py's --slots, the engine's rows)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--max-seconds", type=float, default=20.0, help="each benchmark's time budget")
    parser.add_argument("--max-requests", type=int, default=1000, help="each benchmark's request budget")
    parser.add_argument("--client-processes", type=int, default=1, help="guidellm's worker processes "
                        "(GUIDELLM__MAX_WORKER_PROCESSES; one asyncio process keeps dozens of streams)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of every side")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reports", type=Path, help="keep guidellm's JSON reports (and its logs) here")
    parser.add_argument("--json", type=Path, help="write the record here (bench/results/'s format)")
    parser.add_argument("--target", default="", help="the target the result is checked against (the record's)")
    args, rest = parser.parse_known_args(argv)
    foreign = [arg for arg in rest if arg.startswith("--") and arg.split("=", 1)[0] not in SERVER_OPTIONS]
    if foreign:
        parser.error(f"unrecognized arguments: {' '.join(foreign)}")
    if args.sweep_size < 3:
        parser.error("--sweep-size must be at least 3 (synchronous, throughput, one Poisson rate)")
    servers = peers.parse_args([*rest, "--sides", ",".join(args.sides)])  # it refuses a side it does not know
    if args.max_concurrency is None:
        args.max_concurrency = servers.slots
    return args, servers


def main(argv: list[str] | None = None) -> int:
    """Start every side, warm it, run guidellm's profiles side by side (rotated per repeat), print and write."""
    args, servers = parse_args(argv)
    version = guidellm_version()
    folder = build_smollm2(servers.model)
    every_core = sorted(os.sched_getaffinity(0))
    client_core, server_cores = placement(every_core)
    if client_core is not None:
        os.sched_setaffinity(0, server_cores)  # every server started from here inherits it
    print(f"guidellm {version}; {os.cpu_count()} CPUs, guidellm "
          f"{f'on core {client_core}' if client_core is not None else 'not pinned'}; {folder}; sides {args.sides}; "
          f"profiles {args.profiles}; {args.prompt_tokens} prompt / {args.output_tokens} output tokens; each "
          f"benchmark <= {args.max_seconds:g} s or {args.max_requests} requests; {args.repeats} repeats; load before "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    rows: dict[tuple[str, str], list[Row]] = {}
    loads: list[float] = []
    failures: list[str] = []  # sides that did not start, guidellm runs that failed
    with tempfile.TemporaryDirectory(prefix="trainserve-guidellm-") as tmp:
        home = Path(tmp)
        out = args.reports or home / "reports"
        out.mkdir(parents=True, exist_ok=True)
        sides, failed_sides = peers.start_sides(args.sides, folder, home, servers)
        failures += [f"{name} did not run: {why}" for name, why in failed_sides.items()]
        failures += [side.note for side in sides.values() if side.note]  # a side run other than by its defaults
        try:
            for repeat in range(args.repeats):
                names = list(sides)
                order = names[repeat % len(names):] + names[:repeat % len(names)] if names else []
                for name in order:
                    sides[name].resume()  # the only server running while it is measured
                    for profile in args.profiles:
                        peers.warm(sides[name])
                        stem = out / f"{name}-{profile}-{repeat}"
                        stem.with_suffix(".scenario.json").write_text(json.dumps(
                            scenario(args, sides[name], profile, folder, stem.with_suffix(".json")), indent=1))
                        try:
                            report = run_guidellm(stem.with_suffix(".scenario.json"), stem.with_suffix(".log"),
                                                  client_core, args.client_processes)
                        except RuntimeError as exc:
                            failures.append(f"repeat {repeat} {profile} {name} failed: {exc}")
                            print(failures[-1], flush=True)
                            continue
                        loads.append(os.getloadavg()[0])
                        for point, run in benchmarks(profile, report):
                            rows.setdefault((point, name), []).append({**run, "repeat": repeat})
                            print(f"repeat {repeat} {point} {name}: {run['output_tokens_per_s']:.1f} output tok/s, "
                                  f"TTFT p50 {run['ttft_p50']:.0f} ms, ITL p50 {run['itl_p50']:.1f} ms, e2e p90 "
                                  f"{run['e2e_p90']:.2f} s, {run['completed']} completed, {run['errored']} errors, "
                                  f"{run['incomplete']} incomplete, load {loads[-1]:.1f}", flush=True)
                    sides[name].pause()
        finally:
            for side in sides.values():
                side.close()
            os.sched_setaffinity(0, every_core)
    points = list(dict.fromkeys(point for point, _ in rows))
    rows = {key: rows[key] for key in sorted(rows, key=lambda k: (points.index(k[0]), args.sides.index(k[1])))}
    lines = table(rows) + ratios(rows)
    print("\n" + "\n".join(lines))
    if loads:
        print(f"load average over the runs: {min(loads):.1f}-{max(loads):.1f} (median {statistics.median(loads):.1f})")
    for failure in failures:
        print(failure)
    if args.json is not None:
        record = result_json(args, servers, version, (client_core, server_cores), lines, failures, loads)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
