"""Benchmark: reinforcement fine-tuning's rollout sampler against Hugging Face `generate`, same policy, same batch.

The policy is `bench/generate.py`'s GPT-2-small shape (`--layers`, random weights, eos suppressed so every row
draws exactly `--max-tokens` tokens) with a LoRA adapter on every linear layer, as a reinforcement job trains it.
The batch is `--prompts` prompts (SST-2 sentences) times `--samples` completions each, sampled at temperature 1 with
the full distribution. `ours`: worker.engines.training.rollouts.sample (the training model with its KV cache, a
seeded generator per row); `baseline`: `model.generate(do_sample=True, top_k=0)` on the same left-padded batch.
Prints generated tokens/s of each (`--repeats` timed runs after one warm-up, the best of them) and the ratio.

    python bench/rollouts.py                                       # a smoke run: seconds on 2 cores
    python bench/rollouts.py --layers 12 --prompts 16 --samples 8 --max-tokens 128 --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GPT2TokenizerFast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from bench.generate import build_model  # noqa: E402
from core.adapters import AdapterConfig  # noqa: E402
from worker.engines.training.adapters import apply_adapter  # noqa: E402
from worker.engines.training.rollouts import left_pad, rollout_seed, sample  # noqa: E402

SST2 = ROOT / "examples" / "data" / "sst2_train_4k.tsv"


def sentences(count: int) -> list[str]:
    """The first `count` SST-2 sentences (the prompts)."""
    lines = SST2.read_text().splitlines()[1:count + 1]
    return [line.split("\t")[0] for line in lines]


def best_rate(run, tokens: int, repeats: int, device: str) -> float:
    """Tokens per second of the fastest of `repeats` timed calls (one untimed warm-up first)."""
    run()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return tokens / min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        build_model(Path(folder), args.layers)
        tokenizer = GPT2TokenizerFast.from_pretrained(folder)
        base = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    model = apply_adapter(base, AdapterConfig(r=16, alpha=32, dropout=0.0), "causal-lm").to(args.device).eval()
    prompts = [tokenizer(text)["input_ids"] for text in sentences(args.prompts) for _ in range(args.samples)]
    seeds = [rollout_seed(0, row) for row in range(len(prompts))]
    tokens = len(prompts) * args.max_tokens
    eos = tokenizer.eos_token_id

    def ours() -> None:
        # eos is not a stop token here: every row draws max_tokens, as the baseline's (generation has no eos).
        sample(model, prompts, seeds, max_new_tokens=args.max_tokens, temperature=1.0, stop_ids=set(), pad_id=eos)

    ids, mask = left_pad(prompts, eos, args.device)

    def baseline() -> None:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, pad_token_id=eos)

    rate = best_rate(ours, tokens, args.repeats, args.device)
    base_rate = best_rate(baseline, tokens, args.repeats, args.device)
    print(json.dumps({"rows": len(prompts), "max_tokens": args.max_tokens, "layers": args.layers,
                      "device": args.device, "ours_tokens_per_s": round(rate, 1),
                      "hf_generate_tokens_per_s": round(base_rate, 1), "ratio": round(rate / base_rate, 3)}))


if __name__ == "__main__":
    main()
