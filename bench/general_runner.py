"""The general runner (transformers' own model over the engine's paged cache) against the llama-family runner on the
same model, and against HF `generate`: tokens/s of one burst of greedy requests, sides interleaved per repeat.

The model is SmolLM2-135M-Instruct (`make smollm2`), a Llama, so both runners apply; fp32 on every side (the
precision the equality tests pin). HF `generate` runs the burst as one left-padded batch (its fastest here). Each
measurement runs in a process of its own: OpenMP thread teams left by one side's threads slow the next side's.
Each side's rate counts the tokens it generated (HF is held to --max-new-tokens with min_new_tokens; an engine row
may end at eos first).

Usage: HF_HUB_OFFLINE=1 .venv/bin/python bench/general_runner.py [--requests 16] [--max-new-tokens 32]
       [--repeats 3] [--json bench/results/general-runner-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from bench.generate_engine import default_text, load_prompts  # noqa: E402
from bench.machine import describe, provenance  # noqa: E402
from trainserve.real_models import SMOLLM2_DIR, build_smollm2  # noqa: E402
from worker.engines.generation.engine import GenerationEngine, SamplingParams  # noqa: E402

SIDES = ("llama-family-runner", "general-runner", "hf-generate-batched")


def engine_side(folder: Path, runner: str, prompts: list[str], new: int) -> tuple[float, list[list[int]]]:
    """Seconds for the burst (the model loaded before the clock starts), and each request's tokens."""
    params = SamplingParams(max_new_tokens=new, temperature=0)
    with GenerationEngine(folder, device="cpu", precision="fp32", max_batch_size=len(prompts),
                          runner=runner) as engine:
        engine.generate(prompts[0], SamplingParams(max_new_tokens=2, temperature=0))  # warm-up
        started = time.perf_counter()
        futures = [engine.submit(p, params) for p in prompts]
        results = [f.result() for f in futures]
        return time.perf_counter() - started, [r.choices[0].token_ids for r in results]


def hf_side(model, tokenizer, prompts: list[str], new: int) -> tuple[float, list[list[int]]]:
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        model.generate(**tokenizer(prompts[:1], return_tensors="pt"), max_new_tokens=2, do_sample=False)
        started = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        seconds = time.perf_counter() - started
    return seconds, [row[batch["input_ids"].shape[1]:].tolist() for row in out]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one measurement, in this process
    args = parser.parse_args()
    folder = build_smollm2(SMOLLM2_DIR)
    if args.side:
        prompts = load_prompts(default_text(), args.requests)
        if args.side == "hf-generate-batched":
            tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, padding_side="left")
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            seconds, out = hf_side(model, tokenizer, prompts, args.max_new_tokens)
        else:
            seconds, out = engine_side(folder, "auto" if args.side == "llama-family-runner" else "general", prompts,
                                       args.max_new_tokens)
        print(json.dumps({"seconds": seconds, "outputs": out}))
        return 0
    rates: dict[str, list[float]] = {side: [] for side in SIDES}
    outputs: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):  # interleaved: each repeat runs every side once, in a rotating order
        order = SIDES[repeat % 3:] + SIDES[:repeat % 3]
        for side in order:
            done = subprocess.run([sys.executable, __file__, "--side", side, "--requests", str(args.requests),
                                   "--max-new-tokens", str(args.max_new_tokens)], check=True, capture_output=True,
                                  text=True)
            measured = json.loads(done.stdout.strip().splitlines()[-1])
            seconds, out = measured["seconds"], measured["outputs"]
            tokens = sum(len(row) for row in out)
            rates[side].append(tokens / seconds)
            outputs[side] = out
            print(f"repeat {repeat + 1} {side}: {tokens} tokens, {tokens / seconds:.1f} tok/s", flush=True)
    median = {side: statistics.median(values) for side, values in rates.items()}
    loads = [os.getloadavg()[0]]
    agree = outputs["general-runner"] == outputs["llama-family-runner"]
    equal_hf = all(ours == theirs[:len(ours)] for ours, theirs in
                   zip(outputs["general-runner"], outputs["hf-generate-batched"], strict=True))

    def figure(side: str) -> str:
        values = rates[side]
        return f"{median[side]:.1f} [{min(values):.1f}-{max(values):.1f}]"

    record = {
        "benchmark": "bench/general_runner.py",
        "what": (f"The general runner (transformers' own model over the paged cache) vs the llama-family runner on the "
                 f"same model and vs one batched HF generate: SmolLM2-135M-Instruct, fp32, {args.requests} greedy "
                 f"requests x {args.max_new_tokens} tokens in one burst, each side in its own process, "
                 f"{args.repeats} interleaved repeats, medians [min-max]"),
        "command": f"python bench/general_runner.py --requests {args.requests} --max-new-tokens "
                   f"{args.max_new_tokens} --repeats {args.repeats}",
        "date": time.strftime("%Y-%m-%d"),
        "machine": describe(),
        **provenance("bench/general_runner.py"),
        "load": f"{loads[0]:.1f} (1-minute load average after the runs)",
        "result": (f"general runner {figure('general-runner')} vs llama-family runner {figure('llama-family-runner')} "
                   f"vs HF generate batched {figure('hf-generate-batched')} tokens/s: "
                   f"{median['general-runner'] / median['llama-family-runner']:.2f}x the llama-family runner, "
                   f"{median['general-runner'] / median['hf-generate-batched']:.2f}x HF generate; the two runners' "
                   f"greedy tokens {'identical' if agree else 'DIFFERENT'}, the general runner's "
                   f"{'equal to' if equal_hf else 'DIFFERENT from'} generate's"),
    }
    print(json.dumps(record, indent=2))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
