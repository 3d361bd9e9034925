"""Resident memory of a generation engine in a bare process: after imports, after loading, after a batch.

Usage: HF_HUB_OFFLINE=1 .venv/bin/python bench/generate_memory.py [--model FOLDER] [--layers 12] [--rows 16]
       [--precision auto|fp32|bf16]
Without --model it builds the GPT-2-small-shaped model of bench/generate.py in a temporary folder, in a
child process, so this process imports nothing but the engine. Ratios are against the checkpoint's size
(fp32 here) and, on the last line, against the weight bytes the engine holds at the resolved precision.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: `worker` and `core` live in ROOT

FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
HEAVY = ("sklearn", "scipy", "pandas", "accelerate", "transformers.modeling_utils")


def status() -> dict[str, int]:
    """This process's resident memory fields from /proc, in MiB."""
    text = Path("/proc/self/status").read_text()
    return {field: int(re.search(rf"{field}:\s+(\d+)", text).group(1)) // 1024 for field in FIELDS}  # type: ignore[union-attr]


def line(label: str, weights_mib: float) -> str:
    """One row: RSS, its anonymous and file-backed parts, the peak, and RSS over the weights."""
    now = status()
    return (f"{label:<28}{now['VmRSS']:>7} MiB (anon {now['RssAnon']:>4}, file {now['RssFile']:>4}), peak "
            f"{now['VmHWM']:>5} MiB" + (f", {now['VmRSS'] / weights_mib:.2f}x the weights" if weights_mib else ""))


def main() -> None:
    """Build (or take) the model, then import the engine, load it, run a batch and print memory at each point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="a GPT-2 safetensors folder")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rows", type=int, default=16, help="concurrent requests in the batch")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "gpt2"
            code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
                    "from generate import build_model; build_model(Path(sys.argv[2]), int(sys.argv[3]))")
            subprocess.run([sys.executable, "-c", code, str(ROOT / "bench"), str(model), str(args.layers)], check=True)
        weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        weights_mib = weights / 2**20  # tied embedding stored once
        print(f"checkpoint weights {weights_mib:.0f} MiB ({model})")
        print(line("bare interpreter", weights_mib))
        from core.protocol import SamplingParams
        from worker.engines.generation.engine import GenerationEngine

        print(line("engine imported", weights_mib))
        engine = GenerationEngine(model, device="cpu", precision=args.precision, max_batch_size=args.rows)
        print(line(f"model loaded ({engine.plan.precision})", weights_mib))
        futures = [engine.submit(f"prompt number {i} says", SamplingParams(max_new_tokens=args.max_new_tokens,
                                                                          temperature=0)) for i in range(args.rows)]
        for future in futures:
            future.result()
        time.sleep(0.5)  # the scheduler releases the KV cache once idle
        after = status()["VmRSS"]
        print(line(f"after {args.rows}x{args.max_new_tokens} tokens", weights_mib))
        runner = engine._runner  # what the engine holds: packed projections and LM head, small tensors in its dtype
        packed = sum(t.numel() * t.element_size() for layer in runner.packed or [] for t in layer)
        small = sum(t.numel() * t.element_size() for name, t in runner.tensors.items() if t.dtype == runner.dtype
                    and name not in ("wte.weight", "wpe.weight"))
        held_mib = (packed + small) / 2**20
        print(f"precision {args.precision} -> {engine.plan.precision}: weights held {held_mib:.0f} MiB (packed "
              f"{packed / 2**20:.0f} + other {small / 2**20:.0f}; embeddings stay mapped from the checkpoint, rows "
              f"read as looked up); idle RSS {after} MiB = {after / held_mib:.2f}x the weights held, "
              f"{after / weights_mib:.2f}x the checkpoint")
        print(f"heavy modules imported: {[m for m in HEAVY if m in sys.modules] or 'none'}")
        engine.close()


if __name__ == "__main__":
    main()
