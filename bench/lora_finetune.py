"""Benchmark: a LoRA fine-tune against the full fine-tune of the same causal LM, tokens/s and peak memory.

Both sides are the engine's own causal-LM run (`worker.engines.training.causal_lm.train_lm`) on the same Llama-shaped
model (`bench/generate.py --arch llama`'s: 12 layers, hidden 768, 12 query / 4 kv heads, SwiGLU 2048, tied
embedding, ~115M parameters, random weights from seed 0; `--layers` for a smaller one), the same corpus
(`examples/data/tinyshakespeare_sample.txt`), block size, batch, precision and number of optimizer steps:
- `full` (the baseline): every weight trains, fused AdamW over all of them;
- `lora`: `core.adapters.AdapterConfig` (r 8, alpha 16, all linear layers) through PEFT, the base frozen.
Each run is its own child process, so its peak memory (max resident set on a CPU, max allocated on CUDA) is its
own; sides alternate (full, lora, full, lora, ...) for `--repeats` rounds and the medians are compared. tokens/s
is the engine's `train_tokens_per_second` (training steps only, evaluation excluded) for both sides, so both are
timed over the same window. The saved artifact's size is printed too (the adapter folder against the model's).

    python bench/lora_finetune.py                                  # ~115M Llama shape, 3 rounds
    python bench/lora_finetune.py --layers 2 --steps 4 --repeats 1 # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
CORPUS = ROOT / "examples" / "data" / "tinyshakespeare_sample.txt"


def folder_bytes(folder: Path) -> int:
    """Bytes of the weight files a run saved (safetensors), what a user would store or download."""
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


def one_run(args: argparse.Namespace) -> None:
    """Child process: one fine-tune of one side; prints one JSON line."""
    import torch

    from core.adapters import AdapterConfig
    from worker.engines.training.causal_lm import LMTrainConfig, train_lm

    torch.manual_seed(0)
    adapter = AdapterConfig(r=args.lora_r, alpha=2 * args.lora_r, dropout=0.0) if args.side == "lora" else None
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        config = LMTrainConfig(
            base_model=str(args.model), train_file=CORPUS, eval_file=None, output_dir=Path(tmp) / "model",
            checkpoint_dir=Path(tmp) / "checkpoints", epochs=100, max_steps=args.steps,
            batch_size=args.batch_size, block_size=args.block_size, learning_rate=args.learning_rate,
            weight_decay=0.0, precision=args.precision, device=args.device, base_model_name="bench-llama",
            adapter=adapter)
        result = train_lm(config)
        cuda = torch.cuda.is_available() and args.device != "cpu"
        peak = (torch.cuda.max_memory_allocated() if cuda
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        trainable = (result.manifest.get("adapter") or {}).get("trainable_parameters", "all")
        print(json.dumps({
            "side": args.side, "tokens_per_s": result.metrics["train_tokens_per_second"],
            "peak_bytes": peak, "peak_kind": "cuda allocated" if cuda else "max RSS",
            "artifact_bytes": folder_bytes(Path(tmp) / "model"), "trainable": trainable,
            "precision": result.manifest["hyperparameters"]["precision"], "load": os.getloadavg()[0]}))


def build(folder: Path, layers: int) -> None:
    """The Llama-shaped model of bench/generate.py, saved once for every run."""
    from bench.generate import build_model

    build_model(folder, layers, arch="llama")


def run_side(args: argparse.Namespace, side: str, model: Path) -> dict:
    """One child run of a side; its JSON line."""
    command = [sys.executable, __file__, "--child", "--side", side, "--model", str(model)]
    for name in ("steps", "batch_size", "block_size", "learning_rate", "precision", "device", "lora_r"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(runs: dict[str, list[dict]]) -> None:
    """Per side medians, then LoRA against full."""
    medians = {}
    for side, rows in runs.items():
        speeds = ", ".join(f"{r['tokens_per_s']:.2f}" for r in rows)
        loads = ", ".join(f"{r['load']:.1f}" for r in rows)
        speed = statistics.median(r["tokens_per_s"] for r in rows)
        peak = statistics.median(r["peak_bytes"] for r in rows)
        medians[side] = (speed, peak)
        print(f"{side:>5}: {speed:7.2f} tokens/s (runs {speeds}), "
              f"peak {peak / 1e6:,.0f} MB ({rows[0]['peak_kind']}), artifact {rows[0]['artifact_bytes'] / 1e6:,.1f} MB,"
              f" trainable {rows[0]['trainable']}, precision {rows[0]['precision']}, "
              f"load {loads}")
    (full_speed, full_peak), (lora_speed, lora_peak) = medians["full"], medians["lora"]
    print(f"lora vs full: {lora_speed / full_speed:.2f}x tokens/s, {lora_peak / full_peak:.2f}x peak memory, "
          f"artifact {runs['lora'][0]['artifact_bytes'] / runs['full'][0]['artifact_bytes']:.3f}x")


def main() -> None:
    """Parse options; as the parent, build the model and alternate the sides; as a child, run one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (after the loop's warm-up)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=["full", "lora"], help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.child:
        one_run(args)
        return
    print(f"{os.cpu_count()} CPUs; Llama shape with {args.layers} layers; {args.steps} steps of batch "
          f"{args.batch_size} x block {args.block_size}; precision {args.precision}; {args.repeats} rounds; "
          f"load before {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-lora-model-") as tmp:
        model = Path(tmp) / "llama"
        build(model, args.layers)
        runs: dict[str, list[dict]] = {"full": [], "lora": []}
        for round_ in range(args.repeats):
            for side in ("full", "lora"):
                row = run_side(args, side, model)
                runs[side].append(row)
                print(f"round {round_ + 1} {side}: {row['tokens_per_s']:.2f} tokens/s, "
                      f"peak {row['peak_bytes'] / 1e6:,.0f} MB, load {row['load']:.1f}", flush=True)
        report(runs)


if __name__ == "__main__":
    main()
