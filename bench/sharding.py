"""FSDP2 against DDP on a multi-device job of one host: step time and each rank's peak resident memory.

Usage: python bench/sharding.py [--devices 2] [--hidden 512] [--layers 8] [--steps 6] [--json PATH]

Trains the same causal-LM job (a fresh Llama-shaped model of the given size, saved as a base; full fine-tune, fp32)
under `train_on_devices` once with sharding ddp and once with fsdp, and prints each run's seconds per optimizer step
(training steps only, as the job reports it) and the peak resident set (VmHWM) of each rank process, read from
/proc while the ranks run, with fsdp's ratios against ddp, the named baseline. Two peaks per rank: loading (every
rank loads the whole base model before it is sharded or wrapped) and training (the high-water mark is reset after
the first step, so it holds steps 2.. and the final save).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.tiny_chat import CORPUS, build_chat_tokenizer
from worker.engines.training.causal_lm import LMTrainConfig
from worker.engines.training.launch import train_on_devices
from worker.engines.training.loop_types import TrainCallbacks


def build_base(folder: Path, hidden: int, layers: int) -> tuple[Path, int]:
    """A random Llama of `layers` x `hidden` over the tests' 300-token chat tokenizer; its parameter count."""
    tokenizer = build_chat_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder, sum(p.numel() for p in model.parameters())


class RankPeaks:
    """Polls /proc for the rank processes of a launch and keeps each one's peak resident set (VmHWM)."""

    def __init__(self) -> None:
        self.peaks: dict[int, int] = {}
        self.loading: dict[int, int] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.done.wait(0.2):
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    cmdline = (proc / "cmdline").read_bytes().split(b"\0")
                    if b"worker.engines.training.launch" not in cmdline or b"torch.distributed.run" in cmdline:
                        continue
                    status = (proc / "status").read_text()
                except OSError:
                    continue
                found = re.search(r"VmHWM:\s+(\d+) kB", status)
                if found:
                    pid = int(proc.name)
                    self.peaks[pid] = max(self.peaks.get(pid, 0), int(found.group(1)) * 1024)

    def __enter__(self) -> RankPeaks:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()

    def reset(self) -> None:
        """Keep the peaks so far as the loading ones and restart each rank's high-water mark from its resident set."""
        self.loading = dict(self.peaks)
        for pid in self.peaks:
            try:
                Path(f"/proc/{pid}/clear_refs").write_text("5")
            except OSError:
                pass
        self.peaks.clear()


class AfterFirstStep(TrainCallbacks):
    """Resets the ranks' peaks once step 1 is logged (rank 0 logs after every rank finished the step)."""

    def __init__(self, peaks: RankPeaks) -> None:
        self.peaks = peaks

    def on_log(self, step: int, epoch: float, metrics: dict[str, float]) -> None:
        if step == 1:
            time.sleep(0.5)  # one poll of /proc after the step, so every rank's pid is known
            self.peaks.reset()


def run(root: Path, base: Path, sharding: str, devices: int, steps: int) -> dict[str, object]:
    corpus = root / "corpus.txt"
    corpus.write_text(CORPUS * 8)
    config = LMTrainConfig(train_file=corpus, eval_file=None, output_dir=root / sharding / "out",
                           checkpoint_dir=root / sharding / "ckpt", base_model=str(base), block_size=64, batch_size=8,
                           max_steps=steps, learning_rate=1e-4, seed=1, device="cpu", precision="fp32",
                           devices=devices, sharding=sharding)  # type: ignore[arg-type]
    started = time.perf_counter()
    with RankPeaks() as peaks:
        result = train_on_devices(config, AfterFirstStep(peaks))
    return {"sharding": sharding, "seconds_per_step": result.metrics["train_runtime"] / result.global_step,
            "rank_peak_rss_mb_loading": sorted(round(v / 2**20) for v in peaks.loading.values()),
            "rank_peak_rss_mb": sorted(round(v / 2**20) for v in peaks.peaks.values()),
            "wall_seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-sharding-") as folder:
        root = Path(folder)
        base, parameters = build_base(root / "base", args.hidden, args.layers)
        runs = [run(root, base, sharding, args.devices, args.steps) for sharding in ("ddp", "fsdp")]
    ddp, fsdp = runs
    report = {"parameters": parameters, "devices": args.devices, "runs": runs,
              "fsdp_step_time_vs_ddp": round(float(fsdp["seconds_per_step"]) / float(ddp["seconds_per_step"]), 2),
              "fsdp_peak_rss_vs_ddp": round(max(fsdp["rank_peak_rss_mb"]) / max(ddp["rank_peak_rss_mb"]), 2)}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
