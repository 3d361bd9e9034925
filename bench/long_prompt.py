"""Benchmark: running streams' inter-token latency while a long prompt arrives, chunked prefill on and off.

`--streams` greedy streams decode `--stream-tokens` tokens each; once they have made `--arrive-after` steps, one
`--prompt-tokens` prompt (2,000 by default) arrives. A decode step emits one token to every running stream, so
the time between consecutive decode steps (the engine's on_step hook) is each stream's inter-token latency (ITL).
Per `--chunks` setting (`off`: whole prompts, the baseline; N: fixed N-token chunks, TRAINSERVE_PREFILL_CHUNK_TOKENS=N
with TRAINSERVE_PREFILL_STEP_RATIO=0; `auto`: the default, chunks sized from measured step times so that a step
which prefills takes at most 1.5x a decode step, `auto:R` for ratio R): the streams' ITL
median, p99 and max over their whole run, the p99 of the steps while the long prompt was prefilled (from its
arrival to its first token: the target is at most 2x the median; the step that grows the KV cache for the
long prompt is one of them), their p50, and the long prompt's time to first token.
One engine per setting, loaded and warmed up first; the settings run interleaved (the order rotating per
repeat), medians over `--repeats`, the load average printed after each run. Model: GPT-2-small's width with
`--layers` layers and 4,096 positions, random weights (eos suppressed), fp32 on the CPU.

    python bench/long_prompt.py                                  # 4 layers: off, auto, 256, 64, 32
    python bench/long_prompt.py --layers 2 --repeats 1 --stream-tokens 60 --prompt-tokens 600   # smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Tokenizer  # noqa: E402

from core.paths import GPT2_TOKENIZER_DIR  # noqa: E402
from worker.engines.generation.engine import GenerationEngine, SamplingParams  # noqa: E402


def build(folder: Path, layers: int) -> None:
    """GPT-2-small width, `layers` layers, 4,096 positions (room for the long prompt), random weights."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_positions=4096))
    model.config.eos_token_id = None  # every stream makes exactly its tokens
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder, safe_serialization=True)
    GPT2Tokenizer.from_pretrained(GPT2_TOKENIZER_DIR).save_pretrained(folder)


class Steps:
    """Times of the engine's decode steps that the streams take part in (on_step runs on the scheduler thread
    after each decode step, with its row count; the long prompt's own steps after the streams end are not theirs)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.reached = threading.Event()
        self.arrive_after = 0
        self.streams = 0

    def __call__(self, rows: int) -> None:
        if rows >= self.streams:
            self.times.append(time.perf_counter())
        if len(self.times) >= self.arrive_after:
            self.reached.set()


def run(engine: GenerationEngine, steps: Steps, args: argparse.Namespace) -> dict[str, float]:
    """One trace: the streams start, the long prompt arrives after `arrive_after` steps; ITLs and its TTFT."""
    steps.times, steps.arrive_after, steps.streams = [], args.arrive_after, args.streams
    steps.reached.clear()
    stream = SamplingParams(max_new_tokens=args.stream_tokens, temperature=0)
    with engine._lock:  # the streams start together
        futures = [engine.submit([100 + i, 200 + i, 300 + i], stream) for i in range(args.streams)]
    assert steps.reached.wait(120)
    first: list[float] = []  # the long prompt's first token
    arrived = time.perf_counter()
    long_prompt = [(17 * i) % 50000 + 10 for i in range(args.prompt_tokens)]
    future = engine.submit(long_prompt, SamplingParams(max_new_tokens=2, temperature=0),
                           on_token=lambda i, d: first.append(time.perf_counter()) if not first else None)
    for f in [*futures, future]:
        f.result(300)
    times = steps.times
    pairs = list(zip(times, times[1:], strict=False))
    gaps = sorted(b - a for a, b in pairs)
    # While the prompt is prefilled: the steps that end after it arrived, up to the one giving its first token.
    during = sorted(b - a for a, b in pairs if arrived < b <= first[0]) or [0.0]
    median = statistics.median(gaps)
    # The decode-only pace: the streams' steps before the prompt arrived and after its first token.
    outside = statistics.median([b - a for a, b in pairs if b <= arrived or a >= first[0]] or [median])
    return {"median_ms": median * 1e3, "p99_ms": percentile(gaps, 0.99) * 1e3, "outside_p50_ms": outside * 1e3,
            "during_p50_ms": statistics.median(during) * 1e3, "during_p99_ms": percentile(during, 0.99) * 1e3,
            "max_ms": gaps[-1] * 1e3,
            "during_p99/median": percentile(during, 0.99) / median,
            "during_p99/outside_p50": percentile(during, 0.99) / outside, "ttft_s": first[0] - arrived}


def engine_settings(chunk: str) -> dict[str, float]:
    """GenerationEngine's chunking arguments for a --chunks entry."""
    if chunk == "off":
        return {"prefill_chunk_tokens": 0}
    if chunk.startswith("auto"):
        return {"prefill_step_ratio": float(chunk.partition(":")[2] or 1.5)}
    return {"prefill_chunk_tokens": int(chunk), "prefill_step_ratio": 0}


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of sorted values, nearest rank (the max of fewer than 100 values for p99)."""
    return values[min(len(values) - 1, max(0, round(q * len(values) + 0.5) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=160)
    parser.add_argument("--arrive-after", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--chunks", default="off,auto,256,64,32",
                        help="settings: off (whole prompts), N (fixed chunks), auto or auto:RATIO (measured)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    chunks = args.chunks.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        build(folder, args.layers)
        engines = {}
        for chunk in chunks:
            steps = Steps()
            engine = GenerationEngine(folder, device="cpu", precision="fp32", max_batch_size=8, on_step=steps,
                                      **engine_settings(chunk))
            engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0))  # warm-up, not timed
            engines[chunk] = (engine, steps)
        results: dict[str, list[dict[str, float]]] = {chunk: [] for chunk in chunks}
        for repeat in range(args.repeats):
            order = chunks[repeat % len(chunks):] + chunks[:repeat % len(chunks)]
            for chunk in order:
                results[chunk].append(run(*engines[chunk], args))
                print(f"repeat {repeat} chunk {chunk}: " + ", ".join(f"{k} {v:.3g}" for k, v in
                                                                    results[chunk][-1].items())
                      + f"  (load average {os.getloadavg()[0]:.2f})", flush=True)
        for engine, _ in engines.values():
            engine.close()
    print(f"\n{args.streams} streams x {args.stream_tokens} tokens, a {args.prompt_tokens}-token prompt after "
          f"{args.arrive_after} steps; GPT-2 width, {args.layers} layers, fp32 CPU; medians of {args.repeats}")
    print("ITL p50 and p99 over the streams' whole run; 'during': the steps while the long prompt was prefilled")
    print("'outside': the streams' steps before the prompt arrived and after its first token (decode only)")
    print(f"{'chunks':>12} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'outside p50':>12} {'during p50':>11} "
          f"{'during p99':>11} {'ITL max ms':>11} {'during p99/p50':>15} {'/outside p50':>13} {'long TTFT s':>12}")
    for chunk in chunks:
        m = {key: statistics.median(r[key] for r in results[chunk]) for key in results[chunk][0]}
        print(f"{chunk:>12} {m['median_ms']:>11.1f} {m['p99_ms']:>11.1f} {m['outside_p50_ms']:>12.1f} "
              f"{m['during_p50_ms']:>11.1f} {m['during_p99_ms']:>11.1f} {m['max_ms']:>11.1f} "
              f"{m['during_p99/median']:>15.2f} {m['during_p99/outside_p50']:>13.2f} {m['ttft_s']:>12.2f}")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
