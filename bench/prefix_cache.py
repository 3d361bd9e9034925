"""Benchmark: time to first token of chat requests sharing a long system prompt, prefix caching on and off.

Every request is a chat: one shared `--system-tokens` system prompt (500 by default, Shakespeare) and its own
user message (an SST-2 sentence), rendered as "System: ...\\n\\nUser: ...\\n\\nAssistant:" and asking for
`--max-tokens` greedy tokens. Requests arrive one after another (`--requests` per round), so TTFT is the
prefill itself; the `off` side (TRAINSERVE_PREFIX_CACHE_MB=0, the baseline) prefills every prompt whole, the `on`
side's rows share the cached system prompt's blocks by reference and prefill the rest. Both sides run the same
engine settings otherwise (chunked prefill at its default), rounds interleaved (the side going first alternating),
TTFT p50 and p90 over all rounds, the ratio off / on, whether the two sides' greedy outputs are equal, the cached
tokens per request, and the load average. The `on` side's chats are one tenant's; after each round a new tenant
sends that round's first chat (`other tenant`): the cache is kept per tenant, so it finds nothing and prefills
whole, as the `off` side does. Model: GPT-2-small's width with `--layers` layers, random weights, fp32 CPU.

    python bench/prefix_cache.py                         # 4 layers, 500-token system prompt, 3 rounds of 8
    python bench/prefix_cache.py --layers 2 --rounds 1 --requests 4      # smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from bench.long_prompt import build  # noqa: E402
from worker.engines.generation.engine import GenerationEngine, SamplingParams  # noqa: E402

SST2 = ROOT / "examples" / "data" / "sst2_train_4k.tsv"
SHAKESPEARE = ROOT / "examples" / "data" / "tinyshakespeare_sample.txt"


def prompts(engine: GenerationEngine, args: argparse.Namespace) -> list[str]:
    """The chats of one round: the shared system prompt, then each its own SST-2 sentence."""
    ids = engine.encode(" ".join(SHAKESPEARE.read_text().split()[:1500]))[:args.system_tokens]
    system = engine.tokenizer.decode(ids)
    sentences = [line.split("\t")[0] for line in SST2.read_text().splitlines()[1:] if line.strip()]
    return [f"System: {system}\n\nUser: {s}\n\nAssistant:" for s in sentences[:args.requests * args.rounds]]


def ttft(engine: GenerationEngine, prompt: str, max_tokens: int, tenant: str = "bench") -> tuple[float, list[int], int]:
    """Seconds to the first token, the greedy tokens, the cached prompt tokens."""
    first: list[float] = []
    start = time.perf_counter()
    result = engine.submit(prompt, SamplingParams(max_new_tokens=max_tokens, temperature=0), tenant=tenant,
                           on_token=lambda i, d: first.append(time.perf_counter()) if not first else None).result(300)
    return (first[0] if first else time.perf_counter()) - start, result.choices[0].token_ids, result.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=500)
    parser.add_argument("--requests", type=int, default=8, help="requests per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        build(folder, args.layers)
        sides = {name: GenerationEngine(folder, device="cpu", precision="fp32", max_batch_size=8,
                                        prefix_cache_bytes=size)
                 for name, size in (("off", 0), ("on", 512 << 20))}
        chats = prompts(sides["on"], args)
        for engine in sides.values():  # warm-up, not timed (and not a shared prefix: nothing cached)
            engine.generate("warm up", SamplingParams(max_new_tokens=2, temperature=0))
        times: dict[str, list[float]] = {name: [] for name in sides}
        outputs: dict[str, list[list[int]]] = {name: [] for name in sides}
        cached: list[int] = []
        other: list[tuple[float, int]] = []  # (TTFT, cached tokens) of each round's new tenant
        for r in range(args.rounds):
            order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
            for name in order:
                for chat in chats[r * args.requests:(r + 1) * args.requests]:
                    seconds, tokens, hit = ttft(sides[name], chat, args.max_tokens)
                    times[name].append(seconds)
                    outputs[name].append(tokens)
                    if name == "on":
                        cached.append(hit)
            seconds, _, hit = ttft(sides["on"], chats[r * args.requests], args.max_tokens, tenant=f"other-{r}")
            other.append((seconds, hit))
            print(f"round {r}: TTFT p50 off {statistics.median(times['off']):.3f} s, on "
                  f"{statistics.median(times['on']):.3f} s (load average {os.getloadavg()[0]:.2f})", flush=True)
        prompt_tokens = [len(sides["on"].encode(chat)) for chat in chats]
        for engine in sides.values():
            engine.close()
    p50 = {name: statistics.median(values) for name, values in times.items()}
    p90 = {name: statistics.quantiles(values, n=10)[-1] for name, values in times.items()}
    print(f"\n{len(chats)} chats, {args.system_tokens}-token system prompt, prompts of {min(prompt_tokens)}-"
          f"{max(prompt_tokens)} tokens; GPT-2 width, {args.layers} layers, fp32 CPU")
    print(f"{'prefix cache':>12} {'TTFT p50 s':>11} {'TTFT p90 s':>11}")
    for name in ("off", "on"):
        print(f"{name:>12} {p50[name]:>11.3f} {p90[name]:>11.3f}")
    same = outputs["off"] == outputs["on"]
    print(f"TTFT p50 off / on: {p50['off'] / p50['on']:.2f}x; cached tokens per request: median "
          f"{statistics.median(cached):.0f} (first {cached[0]}); greedy outputs equal: {same}")
    print(f"other tenant, the same chats on the `on` side: TTFT p50 {statistics.median(t for t, _ in other):.3f} s "
          f"(off / other: {p50['off'] / statistics.median(t for t, _ in other):.2f}x); cached tokens "
          f"{[hit for _, hit in other]}")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
