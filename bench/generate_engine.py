"""GPT-2 generation: the continuous-batching engine vs one-at-a-time and batched `model.generate`; print tokens/s.
Random weights with eos suppressed in the saved model, so every side generates exactly --max-new-tokens per request.

Usage: HF_HUB_OFFLINE=1 .venv/bin/python bench/generate_engine.py [--requests 32] [--concurrency 16]
       [--max-new-tokens 64] [--layers 12] [--sampling greedy|seeded] [--threads N] [--batched]
       [--sequential N] [--json PATH] [--repeats 3] [--graphs]
--graphs adds the engine with decode_graphs on (CUDA graphs on a GPU; on a CPU the same padded step uncaptured)
as a side of its own, compared with the ordinary engine: tokens/s, greedy outputs, graphs captured.
Smoke run: ... --requests 4 --concurrency 2 --max-new-tokens 8 --layers 1
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: `worker` lives in ROOT

import torch  # noqa: E402
from transformers import GPT2LMHeadModel, GPT2Tokenizer  # noqa: E402

# GPT-2 small's shape with `layers` blocks, random weights from seed 0, eos suppressed in the saved config and
# generation config: every side (the engine, and both `generate` baselines) produces exactly max_new_tokens.
from bench.generate import build_model  # noqa: E402
from worker.engines.device import resolve_device  # noqa: E402
from worker.engines.generation.engine import GenerationEngine, SamplingParams  # noqa: E402

BASELINE = "sequential-hf-generate"
BATCHED = "batched-hf-generate"
GRAPHS = "graphs-engine"  # the engine with decode_graphs on (--graphs)
SAMPLING = {"temperature": 0.8, "top_k": 50}  # the seeded mode, same settings on both sides


def default_text() -> Path:
    """examples/data/tinyshakespeare_sample.txt when present, else ../shared/data/tinyshakespeare/input.txt."""
    local = ROOT / "examples" / "data" / "tinyshakespeare_sample.txt"
    return local if local.is_file() else ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def load_prompts(source: Path, count: int) -> list[str]:
    """The first `count` lines of at least 30 characters (speaker names and short replies skipped)."""
    lines = [line.strip() for line in source.read_text(encoding="utf-8").splitlines()]
    prompts = [line for line in lines if len(line) >= 30][:count]
    if len(prompts) < count:
        raise SystemExit(f"{source} has only {len(prompts)} usable lines, {count} requested")
    return prompts




def run_baseline(folder: Path, prompts: list[str], args: argparse.Namespace) -> dict:
    """One `model.generate` call per prompt, one after the other (HF's KV cache, batch of one)."""
    tokenizer = GPT2Tokenizer.from_pretrained(folder)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    model = GPT2LMHeadModel.from_pretrained(folder).eval().to(args.device, dtype)
    outputs: list[list[int]] = []

    def generate(index: int, prompt: str) -> list[int]:
        ids = torch.tensor([tokenizer.encode(prompt)], device=args.device)
        kwargs = {"do_sample": False}
        if args.sampling == "seeded":
            torch.manual_seed(index)
            kwargs = {"do_sample": True, **SAMPLING}
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             pad_token_id=tokenizer.eos_token_id, **kwargs)
        return out[0, ids.shape[1]:].tolist()

    with torch.inference_mode():
        generate(0, prompts[0])  # warm-up, not timed
        start = time.perf_counter()
        outputs = [generate(i, p) for i, p in enumerate(prompts)]
        seconds = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    return {"tokens": tokens, "seconds": seconds, "outputs": outputs}


def run_batched(folder: Path, prompts: list[str], args: argparse.Namespace) -> dict:
    """One `model.generate` per `--concurrency` prompts, left padded with an attention mask (greedy only)."""
    tokenizer = GPT2Tokenizer.from_pretrained(folder, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    model = GPT2LMHeadModel.from_pretrained(folder).eval().to(args.device, dtype)
    # eos is suppressed in the saved model (build_model); min_new_tokens keeps it so for any model: equal work
    kwargs = {"do_sample": False, "max_new_tokens": args.max_new_tokens, "min_new_tokens": args.max_new_tokens,
              "pad_token_id": tokenizer.eos_token_id}

    def generate(chunk: list[str]) -> list[list[int]]:
        batch = tokenizer(chunk, return_tensors="pt", padding=True).to(args.device)
        out = model.generate(**batch, **kwargs)
        return out[:, batch["input_ids"].shape[1]:].tolist()

    with torch.inference_mode():
        generate(prompts[: args.concurrency])  # warm-up, not timed
        start = time.perf_counter()
        outputs = [o for i in range(0, len(prompts), args.concurrency)
                   for o in generate(prompts[i:i + args.concurrency])]
        seconds = time.perf_counter() - start
    return {"tokens": sum(len(o) for o in outputs), "seconds": seconds, "outputs": outputs}


def run_engine(folder: Path, prompts: list[str], args: argparse.Namespace, graphs: str = "off") -> dict:
    """All prompts through GenerationEngine from `--concurrency` submitting threads."""
    engine = GenerationEngine(folder, device=args.device, precision=args.precision,
                              max_batch_size=args.max_batch_size, decode_graphs=graphs)
    first_token: dict[int, float] = {}
    submitted: dict[int, float] = {}
    lock = threading.Lock()

    def params(index: int) -> SamplingParams:
        if args.sampling == "seeded":
            return SamplingParams(max_new_tokens=args.max_new_tokens, seed=index, **SAMPLING)
        return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0)

    def one(index: int) -> list[int]:
        def on_token(choice: int, delta: str) -> None:
            with lock:
                first_token.setdefault(index, time.perf_counter())

        submitted[index] = time.perf_counter()
        result = engine.submit(prompts[index], params(index), on_token=on_token).result()
        return result.choices[0].token_ids

    try:
        engine.generate(prompts[0], params(0))  # warm-up, not timed
        before = engine.stats()
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            outputs = list(pool.map(one, range(len(prompts))))
        seconds = time.perf_counter() - start
        after = engine.stats()
        stats = {key: after[key] - before[key] for key in ("steps", "prefills")}
        stats["peak_running_sequences"] = after["peak_running_sequences"]
        if engine._loop.static is not None:  # the padded static steps run (all runs so far) and graphs captured
            stats.update(static_steps=engine._loop.static.steps, captures=engine._loop.static.captures)
    finally:
        engine.close()
    ttft = sorted(first_token[i] - submitted[i] for i in first_token)
    return {"tokens": sum(len(o) for o in outputs), "seconds": seconds, "outputs": outputs, "ttft": ttft,
            "stats": stats}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))]


def interleaved(runners: dict, repeats: int) -> dict[str, list[dict]]:
    """Every side `repeats` times, one round after another, the order rotating each round, so a slow spell of the
    machine or a warm cache does not always favour the same side; each run gets its tokens/s and load average."""
    names = list(runners)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(repeats):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            result = runners[name]()
            result["tokens_per_second"] = result["tokens"] / result["seconds"]
            result["load"] = os.getloadavg()[0]
            runs[name].append(result)
    return runs


def median_run(results: list[dict]) -> dict:
    """The run whose tokens/s is the median (the lower middle one of an even count: use an odd --repeats)."""
    ordered = sorted(results, key=lambda r: r["tokens_per_second"])
    return ordered[(len(ordered) - 1) // 2]


def main() -> None:
    """Parse options, run both sides on the same model and prompts, print the table and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--sampling", choices=("greedy", "seeded"), default="greedy")
    parser.add_argument("--text", type=Path, default=default_text())
    parser.add_argument("--device", default="cpu", help="cpu (the measured setting) or cuda")
    parser.add_argument("--precision", default="fp32", choices=("auto", "fp32", "bf16", "fp16"),
                        help="weights dtype of both sides (the engine through its device plan; auto: what the "
                             "engine's calibration picks, the HF sides follow)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads for both runs (0: default)")
    parser.add_argument("--batched", action="store_true",
                        help="also run batched model.generate, --concurrency prompts per call (greedy)")
    parser.add_argument("--sequential", type=int, default=0,
                        help="sequential generate over the first N prompts only (0: all; its tokens/s does not "
                             "depend on N); -1 skips it")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    parser.add_argument("--graphs", action="store_true",
                        help="also run the engine with decode_graphs on (cuda on a GPU, else eager)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of every side, interleaved, the order rotating each round (medians printed)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    args.precision = resolve_device(args.device, args.precision, generation=True).precision
    prompts = load_prompts(args.text, args.requests)
    print(f"model: GPT-2 small shape, {args.layers} layers, random init (seed 0), {args.precision} on {args.device}, "
          f"{torch.get_num_threads()} torch threads")
    mean_chars = statistics.mean(len(p) for p in prompts)
    print(f"workload: {args.requests} prompts from {args.text.name} (mean {mean_chars:.0f} chars), "
          f"max_new_tokens {args.max_new_tokens}, {args.sampling}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "gpt2"
        build_model(folder, args.layers)
        runners = {}
        if args.sequential >= 0:
            runners[BASELINE] = lambda: run_baseline(folder, prompts[: args.sequential or len(prompts)], args)
        if args.batched:
            runners[BATCHED] = lambda: run_batched(folder, prompts, args)
        if args.graphs:
            mode = "cuda" if torch.device(args.device).type == "cuda" else "eager"
            runners[GRAPHS] = lambda: run_engine(folder, prompts, args, mode)
        engine_name = f"engine ({args.concurrency} submitters)"
        runners[engine_name] = lambda: run_engine(folder, prompts, args)
        runs = interleaved(runners, args.repeats)
    # Per side: the median run by tokens/s (its outputs and engine stats are that run's); every run's TTFT.
    rows = [(name, median_run(results)) for name, results in runs.items()]
    sides = dict(rows[:-1])
    engine = rows[-1][1]
    engine["ttft"] = sorted(t for result in runs[engine_name] for t in result["ttft"])
    print(f"\n{'run':<32} {'tokens':>7} {'seconds':>8} {'tokens/s med [min-max]':>24} {'load':>10}")
    for name, result in rows:
        rates = [r["tokens_per_second"] for r in runs[name]]
        loads = [r["load"] for r in runs[name]]
        rate = f"{result['tokens_per_second']:.1f} [{min(rates):.1f}-{max(rates):.1f}]"
        print(f"{name:<32} {result['tokens']:>7} {result['seconds']:>8.2f} "
              f"{rate:>24} "
              f"{f'{min(loads):.1f}-{max(loads):.1f}':>10}")
    print(f"{args.repeats} rounds, sides interleaved (order rotating); ratios of medians")
    for name, result in sides.items():
        print(f"ratio engine / {name}: {engine['tokens_per_second'] / result['tokens_per_second']:.2f}x")
    ttft = engine["ttft"]
    print(f"engine time to first token: p50 {percentile(ttft, 50) * 1000:.0f} ms, "
          f"p99 {percentile(ttft, 99) * 1000:.0f} ms ({len(ttft)} requests)")
    stats = engine["stats"]
    print(f"engine: {stats['steps']} decode steps, {stats['prefills']} prefills, "
          f"peak batch {stats['peak_running_sequences']} sequences")
    graphs = {}
    if GRAPHS in sides:
        graph_stats = sides[GRAPHS]["stats"]
        graphs = {"ratio": sides[GRAPHS]["tokens_per_second"] / engine["tokens_per_second"],
                  "static_steps": graph_stats.get("static_steps", 0), "captures": graph_stats.get("captures", 0)}
        print(f"graphs-engine / engine: {graphs['ratio']:.2f}x; {graphs['static_steps']} of its decode steps padded "
              f"and static, {graphs['captures']} CUDA graphs captured")
    same = {}
    if args.sampling == "greedy":
        for name, result in sides.items():
            n = len(result["outputs"])
            same[name] = sum(a == b for a, b in zip(result["outputs"], engine["outputs"][:n], strict=True))
            print(f"greedy outputs identical to {name}: {same[name]}/{n}")
    if args.json:
        args.json.write_text(json.dumps({
            "concurrency": args.concurrency, "requests": args.requests, "max_new_tokens": args.max_new_tokens,
            "layers": args.layers, "precision": args.precision, "device": args.device, "torch": torch.__version__,
            "tokens_per_second": {name: r["tokens_per_second"] for name, r in rows},
            "engine": {"ttft_p50_ms": percentile(ttft, 50) * 1000, "ttft_p99_ms": percentile(ttft, 99) * 1000,
                       **stats},
            "greedy_identical": same, "graphs": graphs}, indent=1))


if __name__ == "__main__":
    main()
