"""Benchmark: speculative decoding with prompt-lookup drafts against plain decoding, on neutral chats and on editing
and extraction chats, each set measured on its own.

The same engine settings but `speculative_tokens` (the baseline: 0, plain decoding) decode the same chats (greedy,
or with `--temperature` sampled, chat i seeded `--seed` + i), rendered with the model's chat template over SST-2
sentences (examples/data), the set's four tasks in turn (`--tasks`, both sets by default, in one record):
- extraction: "copy this text with one word changed", "list the words of this text that ..." prompts, answers that
  repeat their input: the narrow tasks a fine-tune serves, and the drafts' best case;
- neutral: open questions about the text (is the review positive and why, what film it might be, questions for its
  critic, a reply that disagrees), answers that are new text: a general chat, where drafts are seldom right and
  speculation, on by default in the service, must cost nothing.
At each `--concurrency` c, `--chats` x c chats (at least 16) run c at a time against one engine (a closed loop: a
finished chat's client sends the next); tokens/s is all generated tokens over the wall time from the first submit to
the last answer (per stream: divided by c). Every answer is compared token for token between the sides: greedy
answers must be equal; a sampled one (the same seed and per-token uniforms on both sides) may part only at a draw
within ROUNDING of the edge between two tokens in the inverse CDF, recomputed in float64, where the logits' last bits
decide (the run stops otherwise). Sides interleaved (the first side alternating per repeat), medians and the spread
over `--repeats`, the draft tokens checked and kept in each set at each concurrency, the load average after each run;
every figure names its set. Engine alone, fp32 on the CPU unless `--precision`, each side with the prefix cache the
service keeps by default (`--prefix-cache-mb`; every run sends chats of its own, each set its own sentences, so only
what chats share is found cached).

    python bench/speculative.py --model ~/.cache/trainserve/smollm2-135m-instruct   # both sets, c = 1 and 16, k = 8
    python bench/speculative.py --model DIR --temperature 0.7   # sampled rows
    python bench/speculative.py --model DIR --tasks neutral --concurrency 1 --repeats 1 --max-tokens 48   # smoke run
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from bench.machine import describe, provenance  # noqa: E402
from core.settings import Settings  # noqa: E402
from worker.engines.generation.engine import GenerationEngine, SamplingParams  # noqa: E402

BASELINE = "plain"
# A sampled draw this close to the edge between two tokens' intervals goes to either with the logits' last bits.
ROUNDING = 1e-5
# Two sets of chats over the same SST-2 sentences. Extraction: answers that repeat their input (the narrow tasks a
# fine-tune serves; drafts' best case). Neutral: open questions about the text whose answers are new text (a general
# chat, where a draft is seldom right and speculation must not cost).
TASK_SETS = {
    "extraction": (
        "Copy the following text exactly, but replace the word \"the\" with \"a\" everywhere. Text: {text}",
        "Repeat the following sentence word for word, then repeat it once more: {text}",
        "Rewrite the text below with every word in lowercase, keeping everything else the same.\n\n{text}",
        "List every word of this text that is longer than four letters, one per line, in order: {text}",
    ),
    "neutral": (
        "Is this movie review positive or negative? Explain your answer in a few sentences.\n\n{text}",
        "What film might this review describe? Guess its genre and say what a viewer should expect.\n\n{text}",
        "Give three questions you would ask the critic who wrote this review.\n\n{text}",
        "Write a short reply to this review from someone who disagrees with it.\n\n{text}",
    ),
}
SET_WHAT = {"extraction": "editing and extraction tasks whose answers repeat their input",
            "neutral": "open questions about the text whose answers are new text"}


def sentences(count: int) -> list[str]:
    """SST-2 sentences (examples/data/sst2_train_4k.tsv), the longer ones first: the texts the tasks repeat."""
    with open(ROOT / "examples" / "data" / "sst2_train_4k.tsv", newline="") as handle:
        rows = [row["sentence"].strip() for row in csv.DictReader(handle, delimiter="\t")]
    return sorted(rows, key=len, reverse=True)[:count]


def chats(engine: GenerationEngine, tasks: tuple[str, ...], texts: list[str]) -> list[list[int]]:
    """A chat per text, the tasks in turn, rendered with the model's chat template."""
    return [engine.encode_chat([{"role": "user", "content": tasks[i % len(tasks)].format(text=text)}])
            for i, text in enumerate(texts)]


def run(engine: GenerationEngine, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0,
        seed: int = 0, concurrency: int | None = None) -> tuple[float, list[list[int]]]:
    """Every prompt, `concurrency` in flight at a time (a closed loop: a finished chat's client sends the next; all at
    once by default); (generated tokens per second over the whole run, each answer's token ids in prompt order)."""
    params = [SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                             seed=None if temperature == 0 else seed + i) for i in range(len(prompts))]

    def chat(i: int) -> list[int]:
        return engine.submit(prompts[i], params[i]).result().choices[0].token_ids

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency or len(prompts)) as clients:
        answers = list(clients.map(chat, range(len(prompts))))
    elapsed = time.perf_counter() - started
    return sum(len(a) for a in answers) / elapsed, answers


@functools.cache
def reference_model(model: str) -> Any:
    """HF's model in float64, loaded once for every answer that parts."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64).eval()


def draw_margin(model: str, prompt: list[int], plain: list[list[int]], drafted: list[list[int]], chat: int, seed: int,
                temperature: float) -> float:
    """How far chat `chat`'s draw at the first token where the two sides part lies from the edge between the two
    tokens' intervals of the inverse CDF, recomputed in float64 (HF's model): a draw that close to an edge goes to
    either token with the last bits of the logits, which a decode step and the drafts' forward sum in different
    orders. The sampler's uniform of that token is the same on both sides (counter-based, per token index)."""
    import torch

    from worker.engines.generation.sampling.sampler import counter_uniforms

    a, b = plain[chat], drafted[chat]
    at = next(j for j in range(min(len(a), len(b)) + 1) if j == min(len(a), len(b)) or a[j] != b[j])
    if at == min(len(a), len(b)):
        return float("inf")  # one side stopped early: not a draw on an edge
    with torch.inference_mode():
        logits = reference_model(model)(torch.tensor([prompt + a[:at]])).logits[0, -1]
    probs = torch.softmax(logits / temperature, dim=-1)
    ends = torch.cumsum(probs, dim=0)
    u = float(counter_uniforms(torch.tensor([seed + chat]), torch.tensor([at]))[0])
    edges = [float(ends[t] - probs[t]) for t in (a[at], b[at])] + [float(ends[t]) for t in (a[at], b[at])]
    return min(abs(u - edge) for edge in edges)


def spread(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}"


def measure(engines: dict[str, GenerationEngine], args: argparse.Namespace, label: str, concurrency: int,
            prompts: list[list[int]], loads: list[float]) -> list[str]:
    """One task set at one concurrency: `--repeats` runs of each side on new chats (`prompts`, a run's worth each,
    in turn), the answers compared; the result's lines, each naming the set."""
    count = len(prompts) // args.repeats
    rates: dict[str, list[float]] = {name: [] for name in engines}
    parted = 0
    speculating = next(name for name in engines if name != BASELINE)
    before = engines[speculating].stats()
    for repeat in range(args.repeats):
        order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
        answers = {}
        sent = prompts[repeat * count:(repeat + 1) * count]
        for name in order:
            rate, answers[name] = run(engines[name], sent, args.max_tokens, args.temperature, args.seed,
                                      concurrency=concurrency)
            rates[name].append(rate)
            loads.append(os.getloadavg()[0])
            print(f"{label} c={concurrency} repeat {repeat + 1} {name}: {rate:.1f} tokens/s (load {loads[-1]:.2f})",
                  flush=True)
        differing = [i for i, (a, b) in enumerate(zip(*answers.values(), strict=True)) if a != b]
        print(f"  answers equal across sides: {count - len(differing)} of {count}")
        if differing and not args.temperature:
            raise SystemExit(f"speculative decoding changed a greedy {label} answer")
        for i in differing:  # sampled: each must part at a draw on the edge between two tokens
            margin = draw_margin(args.model, sent[i], answers[BASELINE], answers[speculating], i, args.seed,
                                 args.temperature)
            print(f"  chat {i} parts at a draw {margin:.1e} from the edge between the two sides' tokens")
            if margin > ROUNDING:
                raise SystemExit(f"speculative decoding changed sampled {label} chat {i} beyond float rounding")
            parted += 1
    after = engines[speculating].stats()
    checked, kept = (after[key] - before[key] for key in ("draft_tokens", "accepted_draft_tokens"))
    base = statistics.median(rates[BASELINE])
    lines = []
    for name, values in rates.items():
        median = statistics.median(values)
        lines.append(f"{label} c={concurrency} {name}: {median:.1f} tokens/s ({median / concurrency:.1f} per stream), "
                     f"spread {spread(values)}, {median / base:.2f}x {BASELINE}")
    lines.append(f"{label} c={concurrency}: {kept} of {checked} draft tokens kept")
    if parted:
        lines.append(f"{label} c={concurrency}: {parted} of {args.repeats * count} sampled answers parted from plain "
                     f"decoding at a draw within {ROUNDING:g} of the edge between two tokens")
    for line in lines:
        print(line, flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a served model's folder (e.g. SmolLM2-135M-Instruct)")
    parser.add_argument("--tasks", nargs="+", choices=list(TASK_SETS), default=list(TASK_SETS),
                        help="the sets of chats, each measured on its own (extraction: answers that repeat their "
                             "input; neutral: open questions about it)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16],
                        help="chats in flight at once (a closed loop)")
    parser.add_argument("--chats", type=int, default=4,
                        help="chats per stream in a run (at least 16 a run), the set's tasks in turn over SST-2 "
                             "sentences")
    parser.add_argument("--k", type=int, default=8, help="the most draft tokens a row checks a step (speculative side)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--prefix-cache-mb", type=float, default=Settings.model_fields["prefix_cache_mb"].default,
                        help="both sides' prefix cache, as the service keeps one (its default); 0: off")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled, seeded per chat")
    parser.add_argument("--seed", type=int, default=0, help="sampled: chat i is seeded seed + i")
    parser.add_argument("--json", type=Path, help="write the result here (bench/results format)")
    parser.add_argument("--target", default="", help="the target the result is judged against (written to --json)")
    args = parser.parse_args()
    top = max(args.concurrency)
    sides = {BASELINE: 0, f"prompt-lookup k={args.k}": args.k}
    engines = {name: GenerationEngine(args.model, device="cpu", precision=args.precision, max_batch_size=top,
                                      speculative_tokens=k, speculative_max_rows=top,
                                      prefix_cache_bytes=int(args.prefix_cache_mb * 2**20))
               for name, k in sides.items()}
    lines: list[str] = []
    loads: list[float] = []
    try:
        # Every run sends chats of its own (both sides the same ones, each set its own sentences): with the prefix
        # cache on, a repeat must not find its whole prompts cached by the one before, only what chats share (the
        # template, the task).
        counts = {c: max(16, args.chats * c) for c in args.concurrency}  # the chats of a run at each concurrency
        per_set = args.repeats * sum(counts.values())
        texts = sentences(1 + per_set * len(args.tasks))
        for engine in engines.values():  # warm up: first forwards allocate and pack
            run(engine, chats(engine, TASK_SETS[args.tasks[0]], texts[-1:]), 8)
        for index, label in enumerate(args.tasks):
            prompts = chats(engines[BASELINE], TASK_SETS[label], texts[index * per_set:(index + 1) * per_set])
            first = 0
            for c in args.concurrency:
                run_prompts, first = prompts[first:first + args.repeats * counts[c]], first + args.repeats * counts[c]
                lines += measure(engines, args, label, c, run_prompts, loads)
    finally:
        for engine in engines.values():
            engine.close()
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "bench/speculative.py",
            "what": f"Speculative decoding (prompt-lookup drafts, k={args.k}) against plain decoding: "
                    f"{'greedy' if args.temperature == 0 else f'sampled (temperature {args.temperature}, seeded)'} "
                    f"chats over SST-2 sentences in {len(args.tasks)} set(s) measured apart, "
                    + ", ".join(f"{label} ({SET_WHAT[label]})" for label in args.tasks)
                    + f"; up to {args.max_tokens} tokens, {args.chats} chats per stream (at least 16) in a closed loop "
                    f"at each concurrency, new chats in every run, engine alone, {args.precision}, prefix cache "
                    f"{args.prefix_cache_mb:g} MB on both sides; the drafts each step checks priced from measured "
                    f"step times; "
                    f"{'answers equal token for token' if not args.temperature else 'answers compared seed for seed'}"
                    f"; medians of {args.repeats} interleaved repeats",
            "command": "python bench/speculative.py " + " ".join(sys.argv[1:]),
            "date": date.today().isoformat(),
            "machine": describe(),
            **provenance("bench/speculative.py"),
            "load": f"{min(loads):.1f}-{max(loads):.1f}",
            "result": "; ".join(lines),
            "target": args.target,
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
