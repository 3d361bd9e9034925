"""The admission estimate against the measured peak: a table of real fine-tunes (method x sequence length x memory
technique) on SmolLM2-135M-Instruct, each run by the real recipe and loop in a fresh process.

Each job trains two optimizer steps (the second holds AdamW's moments beside the activations: the true peak) on
rows of exactly `seq` tokens, on a CPU in fp32, and reports the resident-set peak (VmHWM) above the resident set
just before the run (imports, tokenizer and data files already there), beside the estimate the recipe was admitted
at (its manifest's `memory.estimated_peak_bytes`, less core.estimate's fixed runtime allowance). Techniques:
- `plain`: every position's logits (the chunked loss switched off) and no gradient checkpointing;
- `chunked`: the chunked loss (training/token_loss.py), no checkpointing;
- `chunked+ckpt`: the chunked loss and gradient checkpointing.
An `sft-qlora` row is `sft-lora` over the base in 4-bit NF4 (adapter.quantize_base): the pair gives what the 4-bit
base saves, and their train_loss (two steps at a learning rate too small to move it: the base's loss) what NF4's
rounding costs.
The target: every estimate within 25% of its measured peak, either way.

Usage: HF_HUB_OFFLINE=1 .venv/bin/python bench/training_memory.py [--only sft-lora]
       [--json bench/results/training-memory.json]
       HF_HUB_OFFLINE=1 .venv/bin/python bench/training_memory.py --defaults    # the default jobs, full size
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import describe, provenance  # noqa: E402
from trainserve.real_models import SMOLLM2_DIR, build_smollm2  # noqa: E402

TECHNIQUES = ("plain", "chunked", "chunked+ckpt")
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
GRADER = {"type": "string_check", "name": "has answer", "input": "{{sample.output_text}}",
          "reference": "{{item.answer}}", "operation": "like"}


@dataclass(frozen=True)
class Job:
    """One row of the table: a method, its adapter (or full weights), rows per micro-batch and their length."""

    method: str  # sft | dpo | grpo
    lora: bool
    batch: int
    seq: int  # tokens per row (a GRPO row: prompt + max_completion_tokens)
    technique: str
    quantize: bool = False  # the adapter's base in 4-bit NF4 (QLoRA)
    completion: int = 64  # a GRPO row's max_completion_tokens

    @property
    def name(self) -> str:
        """E.g. 'sft-lora b2x1024 chunked+ckpt'."""
        weights = "qlora" if self.quantize else "lora" if self.lora else "full"
        return f"{self.method}-{weights} b{self.batch}x{self.seq} {self.technique}"


def table() -> list[Job]:
    """The jobs measured: each method at two lengths, under each technique (those that fit this machine)."""
    jobs = []
    for method, lora, batch, lengths in (("sft", True, 2, (512, 2048)), ("sft", False, 2, (512, 2048)),
                                         ("dpo", True, 1, (512, 1024)), ("grpo", False, 2, (256, 512))):
        for seq in lengths:
            jobs.extend(Job(method, lora, batch, seq, technique) for technique in TECHNIQUES)
    jobs.extend(Job("sft", True, 2, seq, technique, quantize=True) for seq in (512, 2048) for technique in TECHNIQUES)
    return jobs


def defaults() -> list[Job]:
    """The defaults a job gets, at the sizes the training-scale issue names: a LoRA of 8 conversations of 2,048
    tokens, and a reinforcement job in full of 8 prompts x 4 samples with 32-token answers; `auto` leaves gradient
    checkpointing to the estimate (on where the job would not fit this machine without it), as a job's null does."""
    return [Job("sft", True, 8, 2048, "auto"), Job("grpo", False, 8, 256, "auto", completion=32)]


def _rss(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    match = re.search(field + r":\s+(\d+) kB", status)
    assert match is not None
    return int(match.group(1)) * 1024


def _words(count: int, seed: int) -> str:
    # Common short words: about one SmolLM2 token each, so a reply of `count` words reaches `count` tokens.
    vocabulary = ("the cat sat on a mat and then it ran to see what was in the box by the door of our old house "
                  "near one big tree").split()
    return " ".join(vocabulary[(seed * 7 + i * 3) % len(vocabulary)] for i in range(count))


def _data(job: Job, folder: Path) -> Path:
    """A training file whose rows all reach `seq` tokens (cut there by max_length)."""
    path = folder / "train.jsonl"
    rows = []
    for i in range(max(4, job.batch * 2)):
        if job.method == "sft":
            rows.append({"messages": [{"role": "user", "content": _words(16, i)},
                                      {"role": "assistant", "content": _words(job.seq, i + 1)}]})
        elif job.method == "dpo":
            rows.append({"input": {"messages": [{"role": "user", "content": _words(16, i)}]},
                         "preferred_output": [{"role": "assistant", "content": _words(job.seq, i + 1)}],
                         "non_preferred_output": [{"role": "assistant", "content": _words(job.seq, i + 2)}]})
        else:
            rows.append({"messages": [{"role": "user", "content": _words(job.seq - 112, i)}], "answer": "cat"})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def measure(job: Job) -> dict[str, float | str]:
    """Run one job in this process (a fresh one: see main) and return its estimate and measured peak."""
    import torch

    from core.adapters import AdapterConfig, PreferenceConfig
    from core.estimate import RUNTIME_BYTES
    from core.reinforcement import ReinforcementConfig
    from worker.engines.training import token_loss
    from worker.engines.training.chat import ChatRecipe, ChatTrainConfig
    from worker.engines.training.loop import run
    from worker.engines.training.reinforcement import ReinforcementRecipe, ReinforcementTrainConfig

    torch.set_num_threads(os.cpu_count() or 1)
    if job.technique == "plain":  # the model's own logits for every position: the loss as it was before
        token_loss.output_head = lambda model: None  # type: ignore[assignment]
    folder = Path(tempfile.mkdtemp(prefix="training-memory-"))
    common = dict(train_file=_data(job, folder), eval_file=None, output_dir=folder / "out",
                  checkpoint_dir=folder / "ckpt", base_model=str(SMOLLM2_DIR),
                  adapter=AdapterConfig(**LORA, quantize_base="nf4" if job.quantize else None) if job.lora else None,
                  max_steps=2, batch_size=job.batch,
                  learning_rate=1e-5, seed=0, device="cpu", precision="fp32",
                  gradient_checkpointing=None if job.technique == "auto" else job.technique.endswith("ckpt"))
    config: ChatTrainConfig
    if job.method == "grpo":
        rl = ReinforcementConfig(grader=GRADER, samples=4, max_completion_tokens=job.completion, beta=0.0)
        config = ReinforcementTrainConfig(**common, max_length=job.seq - job.completion, reinforcement=rl)
        recipe: ChatRecipe | ReinforcementRecipe = ReinforcementRecipe(config)
    else:
        config = ChatTrainConfig(**common, max_length=job.seq,
                                 preference=PreferenceConfig(beta=0.1) if job.method == "dpo" else None)
        recipe = ChatRecipe(config)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here: what the run adds
    before = _rss("VmRSS")
    started = time.perf_counter()
    result = run(config, recipe)
    peak = _rss("VmHWM") - before
    memory = result.manifest["hyperparameters"]["memory"]
    estimate = memory["estimated_peak_bytes"] - RUNTIME_BYTES
    return {"job": job.name, "estimate_gb": estimate / 1e9, "measured_gb": peak / 1e9, "ratio": estimate / peak,
            "loss": memory["loss"], "checkpointing": memory["gradient_checkpointing"],
            "train_loss": result.metrics["train_loss"],
            "step_seconds": result.metrics["train_runtime"] / result.global_step,
            "seconds": time.perf_counter() - started}


def describe_row(row: dict[str, float | str]) -> str:
    """One job's line of the result: 'sft-lora b2x512 chunked 3.17 / 3.28 GB (0.97x), 14.0 s a step'."""
    if "error" in row:
        return f"{row['job']} failed: {row['error']}"
    return (f"{row['job']} {float(row['estimate_gb']):.2f} / {float(row['measured_gb']):.2f} GB "
            f"({float(row['ratio']):.2f}x), {float(row['step_seconds']):.1f} s a step")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run the jobs whose name contains this")
    parser.add_argument("--defaults", action="store_true", help="the default jobs (defaults()) instead of the table")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a job to measure in this process (JSON)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(Job(**json.loads(args.one)))))
        return 0
    build_smollm2()
    rows, loads = [], []
    for job in defaults() if args.defaults else table():
        if args.only and args.only not in job.name:
            continue
        loads.append(os.getloadavg()[0])
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, __file__, "--one", json.dumps(job.__dict__)], env=env, cwd=ROOT,
                              capture_output=True, text=True)
        if done.returncode != 0:
            row: dict[str, float | str] = {"job": job.name, "error": done.stderr.strip().splitlines()[-1]}
        else:
            row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    within = [r for r in rows if "ratio" in r and 0.75 <= float(r["ratio"]) <= 1.25]
    summary = f"{len(within)} of {len(rows)} estimates within 25% of the measured peak"
    print(summary)
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "bench/training_memory.py",
            "what": "admission estimate (less the 1 GB runtime allowance) vs measured resident-set peak above the "
                    "resident set before the run, two optimizer steps of SmolLM2-135M-Instruct fine-tunes on a CPU "
                    "in fp32 (GRPO: 4 samples a prompt, 64-token completions; the default job 32); GB estimated / "
                    "measured (ratio), seconds per step",
            "command": "python bench/training_memory.py " + " ".join(sys.argv[1:]),
            "date": datetime.now(UTC).strftime("%Y-%m-%d"), "machine": describe(),
            **provenance("bench/training_memory.py"),
            "load": f"{min(loads):.1f}-{max(loads):.1f}" if loads else "",
            "result": "; ".join([summary, *map(describe_row, rows)])}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
