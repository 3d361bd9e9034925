"""Benchmark: the paged KV cache's memory per request against its tokens' KV size, on a real model.

`--requests` chats of mixed lengths (SST-2 instructions, a random 0-`--max-context` tokens of Tiny Shakespeare
before some of them, `--min-tokens`..`--max-tokens` new tokens) run in one engine at once (greedy, no prefix cache,
so every block is one request's). After every decode step (the engine's on_step hook, on its scheduler thread) the
benchmark reads what the running requests hold: their blocks (a block shared by n choices counted once) against
their tokens' KV size (tokens in the cache x layers x 2 x kv heads x head_dim x element bytes), and the pool's
whole size against the same. The baseline is the tokens' own KV size (the target: held <= 1.10x); beside it, what
a cache of one row per sequence sized to the longest would take at the same step (rows x the longest row's
positions, both rounded up to a power of two as such caches grow by doubling). Steps with fewer than
`--requests` / 2 running requests are left out (the tail of the run, where a few long rows remain). Repeats rotate
the seed; medians and the worst step over all.

    python bench/paged_memory.py                         # SmolLM2-135M-Instruct, fp32, 16 requests, 3 repeats
    python bench/paged_memory.py --requests 8 --max-tokens 48 --repeats 1    # smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from bench.machine import describe, provenance  # noqa: E402
from trainserve.real_models import SMOLLM2_DIR, build_smollm2  # noqa: E402
from worker.engines.generation.caches.paged_cache import BLOCK  # noqa: E402
from worker.engines.generation.engine import GenerationEngine, SamplingParams  # noqa: E402
from worker.engines.generation.tokenizer import chat_ids  # noqa: E402

DATA = ROOT / "examples" / "data"
SST2, SHAKESPEARE = DATA / "sst2_train_4k.tsv", DATA / "tinyshakespeare.txt"


def pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


class Held:
    """After each decode step: the running requests' blocks, their tokens, the pool, and a row cache's positions."""

    def __init__(self, requests: int) -> None:
        self.engine: GenerationEngine | None = None
        self.least = requests // 2
        self.samples: list[dict[str, float]] = []

    def __call__(self, _rows: int) -> None:
        engine = self.engine
        if engine is None:
            return
        rows = engine._loop.rows.rows  # on the scheduler thread: the rows as this step left them
        if len({id(s.request) for s in rows}) < self.least:
            return
        cache = engine._runner.cache
        blocks = {block for row in range(len(rows)) for block in cache.tables[row]}
        tokens = sum(s.position for s in rows)
        longest = max(len(s.request.prompt) + s.request.params.max_new_tokens for s in rows)
        self.samples.append({"held": len(blocks) * BLOCK / tokens, "pool": (cache.blocks - 1) * BLOCK / tokens,
                             "rows": pow2(len(rows)) * pow2(longest) / tokens, "tokens": tokens})


def chats(args: argparse.Namespace, seed: int, engine: GenerationEngine) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    sentences = [line.split("\t")[0].strip() for line in SST2.read_text().splitlines()[1:] if line.strip()]
    words = SHAKESPEARE.read_text().split()
    out = []
    for _ in range(args.requests):
        context = ""
        if rng.random() < 0.5:  # half carry a passage: prompts from a few dozen to max-context tokens
            start = rng.randrange(len(words) - 4 * args.max_context)
            context = " ".join(words[start:start + rng.randint(10, args.max_context)]) + "\n\n"
        messages = [{"role": "user", "content": f"{context}Rewrite this review politely: {rng.choice(sentences)}"}]
        out.append((chat_ids(engine.tokenizer, messages), rng.randint(args.min_tokens, args.max_tokens)))
    return out


def run(engine: GenerationEngine, held: Held, args: argparse.Namespace, seed: int) -> list[dict[str, float]]:
    held.samples = []
    requests = chats(args, seed, engine)
    with engine._lock:  # admitted together
        futures = [engine.submit(prompt, SamplingParams(max_new_tokens=n, temperature=0))
                   for prompt, n in requests]
    for future in futures:
        future.result(600)
    return held.samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=SMOLLM2_DIR, help="the HF folder (built when missing)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--min-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-context", type=int, default=600, help="most words of a passage before the request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--out", type=Path, help="write the result JSON here")
    args = parser.parse_args()
    folder = build_smollm2(args.model)
    held = Held(args.requests)
    engine = GenerationEngine(folder, device="cpu", precision=args.precision, max_batch_size=args.requests,
                              on_step=held)
    held.engine = engine
    per_run: list[dict[str, float]] = []
    worst = {"held": 0.0, "pool": 0.0}
    with engine:
        for repeat in range(args.repeats):
            samples = run(engine, held, args, seed=repeat)
            summary = {key: statistics.median(s[key] for s in samples) for key in ("held", "pool", "rows", "tokens")}
            for key in worst:
                worst[key] = max(worst[key], max(s[key] for s in samples))
            per_run.append(summary)
            print(f"repeat {repeat}: {len(samples)} steps, median {summary['tokens']:.0f} tokens held; held/KV "
                  f"{summary['held']:.3f} (worst {max(s['held'] for s in samples):.3f}), pool/KV {summary['pool']:.3f}"
                  f", one-row-per-sequence/KV {summary['rows']:.2f}; load {os.getloadavg()[0]:.2f}", flush=True)
    med = {key: statistics.median(r[key] for r in per_run) for key in ("held", "pool", "rows")}
    result = (f"blocks held / the tokens' KV size: median {med['held']:.3f}x (worst step {worst['held']:.3f}x); "
              f"the whole pool / KV: {med['pool']:.3f}x (worst {worst['pool']:.3f}x); a cache of one row per "
              f"sequence grown by doubling would hold {med['rows']:.2f}x at the same steps "
              f"({len(per_run)} repeats, {args.requests} requests of mixed lengths)")
    print(result)
    if args.out:
        record: dict[str, Any] = {
            "benchmark": "bench/paged_memory.py",
            "what": f"KV cache memory per running request on SmolLM2-135M-Instruct ({args.precision}), "
                    f"{args.requests} chats of mixed lengths at once, against their tokens' own KV size",
            "command": "python bench/paged_memory.py" + "".join(
                f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                if k not in ("model", "out") and v != parser.get_default(k)),
            "date": datetime.date.today().isoformat(), "machine": describe(), **provenance("bench/paged_memory.py"),
            "load": "not relevant (memory)", "result": result,
            "target": f"held <= 1.10x the tokens' KV size: {'met' if med['held'] <= 1.10 else 'not met'}"}
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
