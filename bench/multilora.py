"""Multi-adapter generation throughput: the serving engine decoding a batch whose rows are spread over 1, 4 or 16
distinct LoRA adapters, against the same batch on the base alone (the named baseline, `base`).

A random Llama-shaped model (GQA, untied head whose eos row is zero so no row stops early) and random rank-r
adapters on all seven projections are written to a temporary folder; one GenerationEngine serves every side
(adapters made resident by a warm-up, as a busy server holds them). Each measurement submits `--rows` requests
together (same prompts on every side: one prefill, then decode steps of all rows) and counts generated tokens
over the wall time. Sides are interleaved, rotated each round, `--repeats` rounds; prints medians, the load
average and each side's ratio of the base's tokens/s. Never asserts timings.

Usage: HF_HUB_OFFLINE=1 .venv/bin/python bench/multilora.py [--rows 32] [--hidden 512] [--layers 4] [--rank 8]
       [--max-new-tokens 32] [--repeats 5] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from tests.tiny_llama import save_tokenizer  # noqa: E402
from worker.engines.generation.engine import GenerationEngine, SamplingParams  # noqa: E402

BASELINE = "base"
COUNTS = (1, 4, 16)
SHAPES = {"q_proj": ("self_attn", "hidden", "q"), "k_proj": ("self_attn", "hidden", "kv"),
          "v_proj": ("self_attn", "hidden", "kv"), "o_proj": ("self_attn", "q", "hidden"),
          "gate_proj": ("mlp", "hidden", "inter"), "up_proj": ("mlp", "hidden", "inter"),
          "down_proj": ("mlp", "inter", "hidden")}


def build_base(folder: Path, args: argparse.Namespace) -> dict[str, int]:
    """A random Llama of the asked shape with a byte-level tokenizer; returns its widths by name."""
    tokenizer = save_tokenizer("bytelevel", folder)
    heads = max(1, args.hidden // 64)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 4), max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = 0  # a zero logit never wins greedily: every row decodes all
    model.save_pretrained(folder, safe_serialization=True)
    kv = config.num_key_value_heads * (args.hidden // heads)
    return {"hidden": args.hidden, "q": args.hidden, "kv": kv, "inter": config.intermediate_size}


def build_adapter(folder: Path, base: Path, widths: dict[str, int], layers: int, rank: int, seed: int) -> Path:
    """A PEFT-format LoRA folder (all seven projections, rank `rank`) with random A and B."""
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for name, (block, fan_in, fan_out) in SHAPES.items():
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, widths[fan_in], generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(widths[fan_out], rank, generator=generator) * 0.02
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(SHAPES),
        "base_model_name_or_path": str(base), "bias": "none"}))
    return folder


def run(engine: GenerationEngine, prompts: list[list[int]], adapters: list[str | None], new: int) -> float:
    """Tokens per second of one batch: row i through adapters[i] (None: the base)."""
    params = SamplingParams(max_new_tokens=new, temperature=0)
    start = time.perf_counter()
    with engine._lock:  # admitted together: one prefill, then every step decodes all rows
        futures = [engine.submit(p, params, adapter=a) for p, a in zip(prompts, adapters, strict=True)]
    tokens = sum(f.result().completion_tokens for f in futures)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared CPU)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        widths = build_base(base, args)
        names = [f"a{i}" for i in range(max(COUNTS))]
        folders = {n: build_adapter(Path(tmp) / n, base, widths, args.layers, args.rank, i)
                   for i, n in enumerate(names)}
        generator = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 500, (args.prompt_tokens,), generator=generator).tolist()
                   for _ in range(args.rows)]
        sides = {BASELINE: [None] * args.rows,
                 **{f"{k}-adapters": [names[i % k] for i in range(args.rows)] for k in COUNTS}}
        with GenerationEngine(base, device=args.device, precision="fp32", max_batch_size=args.rows,
                                  max_loras=max(COUNTS), adapter_folder=folders.__getitem__) as engine:
            run(engine, prompts, sides[f"{max(COUNTS)}-adapters"], 2)  # warm-up: all adapters resident
            run(engine, prompts, sides[BASELINE], 2)
            rates: dict[str, list[float]] = {side: [] for side in sides}
            order = list(sides)
            for round_ in range(args.repeats):
                for side in order[round_ % len(order):] + order[:round_ % len(order)]:  # interleaved, rotated
                    rates[side].append(run(engine, prompts, sides[side], args.max_new_tokens))
            plan = engine.plan
    base_rate = statistics.median(rates[BASELINE])
    print(f"rows={args.rows} hidden={args.hidden} layers={args.layers} rank={args.rank} new={args.max_new_tokens} "
          f"repeats={args.repeats} threads={args.threads} device={plan.device} precision={plan.precision} "
          f"load={os.getloadavg()[0]:.2f}")
    for side, values in rates.items():
        rate = statistics.median(values)
        print(f"{side:>12}: {rate:8.1f} tokens/s (median of {len(values)}; min {min(values):.1f} max "
              f"{max(values):.1f})  base/this = {base_rate / rate:.2f}x")


if __name__ == "__main__":
    main()
