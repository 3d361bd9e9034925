"""trainserve's fine-tunes against TRL's trainers on the same model, data and settings: tokens/s and peak memory.

Both sides train SmolLM2-135M-Instruct (the real model, `make smollm2`) for one epoch over the same chat rows on a
CPU in fp32, with the same batch, learning rate, linear schedule without warmup, no weight decay and the same LoRA
(r 16, alpha 32, no dropout, every linear layer) or full weights:
- `sft`: trainserve's chat recipe (worker.engines.training.chat: assistant-token loss, chunked, packed where it
  saves work) against TRL's `SFTTrainer` on prompt-completion rows (completion-only loss), given its best options
  on this machine (`--trl-sft`: `padding_free` by default: rows concatenated without padding, positions restarting;
  `packing` (best-fit decreasing) and `padded` are the others), gradient checkpointing off on both (it fits);
- `dpo`: trainserve's DPO (the same recipe with `preference`) against TRL's `DPOTrainer` (sigmoid loss, beta 0.1,
  the reference the base with the adapter switched off; trainserve's DPO trains an adapter, so LoRA only).
- `grpo`: trainserve's reinforcement recipe against TRL's `GRPOTrainer`, 4 completions a prompt of at most 32
  tokens sampled at temperature 1, beta 0 (no reference), the reward 1 where the completion holds the answer
  (trainserve's string_check `ilike` grader, a Python function on TRL's side); tokens are each sample's prompt and
  completion at the side's own mean completion length, and the rounds are compared by their mean reward.
Each run is a fresh child process; sides alternate (trainserve, TRL, trainserve, ...) for `--repeats` rounds.
tokens/s is the epoch's tokens (prompt and reply; both replies of a DPO pair) over the seconds spent in optimizer
steps (each side's own step timing: trainserve's `train_runtime`, TRL's from a callback at each step's start and
end), so loading, tokenizing and saving are outside both windows. Peak memory is the resident-set peak (VmHWM) above
the resident set after imports, before the model loads, under the same allocator on both sides (`--allocator`:
glibc's, which keeps freed blocks of either side's activations, or jemalloc's, closer to what the tensors need).
Both sides' trained models are then scored by one function over the epoch's rows (SFT: the assistant tokens'
cross-entropy; DPO: its loss against the untrained base), beside each side's first logged step loss.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/trl_compare.py --rows 16 --batch-size 4 --only sft,dpo
    HF_HUB_OFFLINE=1 .venv/bin/python bench/trl_compare.py --rows 8 --batch-size 2 --only grpo
    HF_HUB_OFFLINE=1 .venv/bin/python bench/trl_compare.py --only sft-lora --rows 16 --repeats 1   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import describe, provenance  # noqa: E402
from bench.training_memory import _rss, _words  # noqa: E402
from trainserve.real_models import SMOLLM2_DIR, build_smollm2  # noqa: E402

LORA = {"r": 16, "alpha": 32, "dropout": 0.0}
JOBS = ("sft-lora", "sft-full", "dpo-lora", "grpo-lora", "grpo-full")  # trainserve's DPO trains an adapter
# What tells whether a side learned as the other did: the trained model's loss, or GRPO's mean reward over the run.
QUALITY = {"sft": "final_loss", "dpo": "final_loss", "grpo": "reward"}
SAMPLES, COMPLETION = 4, 32  # GRPO: completions per prompt, and tokens per completion at most (the defaults)
RATES = {"lora": 2e-4, "full": 2e-5}
JEMALLOC = "/lib/x86_64-linux-gnu/libjemalloc.so.2"  # Debian's libjemalloc2


def rows(method: str, count: int, longest: int) -> list[dict[str, Any]]:
    """Chat rows whose replies run from 32 words to `longest`, spread evenly, as real chat data varies."""
    out: list[dict[str, Any]] = []
    for i in range(count):
        words = 32 + (longest - 32) * ((i * 7) % count) // max(1, count - 1)
        prompt = [{"role": "user", "content": f"Question {i}: " + _words(12, i)}]
        if method == "sft":
            out.append({"prompt": prompt, "completion": [{"role": "assistant", "content": _words(words, i + 1)}]})
        else:
            out.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": _words(words, i + 1)}],
                        "rejected": [{"role": "assistant", "content": _words(words, i + 2)}]})
    return out


def prompts(count: int) -> list[dict[str, Any]]:
    """GRPO's rows: a question whose one-word answer the reward checks for in the completion."""
    words = ("mat", "box", "door", "tree", "house", "cat", "sky", "sea")
    return [{"prompt": [{"role": "user", "content": f"Question {i}: " + _words(10, i) + ". Which word ends this: "
                         f"'the cat sat on the {words[i % len(words)]}'? Reply with that word only."}],
             "answer": words[i % len(words)]} for i in range(count)]


def prompt_tokens(data: list[dict[str, Any]]) -> float:
    """The mean length of GRPO's rendered prompts (the generation prompt included)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2_DIR))
    lengths = []
    for row in data:
        ids = tokenizer.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True)
        lengths.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return statistics.fmean(lengths)


def epoch_tokens(method: str, data: list[dict[str, Any]], max_length: int) -> int:
    """Tokens in one epoch: each rendered conversation (both of a DPO pair), cut at max_length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2_DIR))
    total = 0
    for row in data:
        replies = [row["completion"]] if method == "sft" else [row["chosen"], row["rejected"]]
        for reply in replies:
            ids = tokenizer.apply_chat_template(row["prompt"] + reply, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            total += min(len(ids), max_length)
    return total


def run_trainserve(job: str, data: list[dict[str, Any]], args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from core.adapters import AdapterConfig, PreferenceConfig
    from core.estimate import RUNTIME_BYTES
    from worker.engines.training.chat import ChatRecipe, ChatTrainConfig
    from worker.engines.training.loop import run
    from worker.engines.training.loop_types import TrainCallbacks

    method, weights = job.split("-")
    train = folder / "train.jsonl"
    with train.open("w") as out:
        for row in data:
            if method == "sft":
                out.write(json.dumps({"messages": row["prompt"] + row["completion"]}) + "\n")
            else:
                out.write(json.dumps({"input": {"messages": row["prompt"]}, "preferred_output": row["chosen"],
                                      "non_preferred_output": row["rejected"]}) + "\n")
    losses: list[float] = []

    class Losses(TrainCallbacks):
        def on_log(self, step: int, epoch: float, metrics: dict[str, float]) -> None:
            losses.append(metrics["train_loss"])

    config = ChatTrainConfig(
        train_file=train, eval_file=None, output_dir=folder / "out", checkpoint_dir=folder / "ckpt",
        base_model=str(SMOLLM2_DIR), adapter=AdapterConfig(**LORA, target_modules="all-linear")
        if weights == "lora" else None, preference=PreferenceConfig(beta=0.1) if method == "dpo" else None,
        epochs=1, batch_size=args.batch_size, learning_rate=RATES[weights], warmup_ratio=0.0, weight_decay=0.0,
        max_length=args.max_length, seed=args.seed, device="cpu", precision="fp32", gradient_checkpointing=False)
    result = run(config, ChatRecipe(config), Losses())
    memory = result.manifest["hyperparameters"]["memory"]
    return {"model": lambda: _saved_model(result.model_dir, weights), "seconds": result.metrics["train_runtime"],
            "losses": losses, "steps": result.global_step,
            "technique": f"loss {memory['loss']}, packing {memory.get('packing')}",
            "estimate_gb": (memory["estimated_peak_bytes"] - RUNTIME_BYTES) / 1e9}


def run_trainserve_grpo(job: str, data: list[dict[str, Any]], args: argparse.Namespace,
                        folder: Path) -> dict[str, Any]:
    from core.adapters import AdapterConfig
    from core.reinforcement import ReinforcementConfig
    from worker.engines.training.loop import run
    from worker.engines.training.loop_types import TrainCallbacks
    from worker.engines.training.reinforcement import ReinforcementRecipe, ReinforcementTrainConfig

    weights = job.split("-")[1]
    train = folder / "train.jsonl"
    train.write_text("".join(json.dumps({"messages": row["prompt"], "answer": row["answer"]}) + "\n" for row in data))
    logs: list[dict[str, float]] = []

    class Logs(TrainCallbacks):
        def on_log(self, step: int, epoch: float, metrics: dict[str, float]) -> None:
            logs.append(metrics)

    grader = {"type": "string_check", "name": "answer", "input": "{{sample.output_text}}",
              "reference": "{{item.answer}}", "operation": "ilike"}
    config = ReinforcementTrainConfig(
        train_file=train, eval_file=None, output_dir=folder / "out", checkpoint_dir=folder / "ckpt",
        base_model=str(SMOLLM2_DIR), adapter=AdapterConfig(**LORA, target_modules="all-linear")
        if weights == "lora" else None, epochs=1, batch_size=args.batch_size, learning_rate=RATES[weights],
        warmup_ratio=0.0, weight_decay=0.0, max_length=args.max_length, seed=args.seed, device="cpu",
        precision="fp32", gradient_checkpointing=False,
        reinforcement=ReinforcementConfig(grader=grader, samples=SAMPLES, max_completion_tokens=COMPLETION, beta=0.0))
    result = run(config, ReinforcementRecipe(config), Logs())
    return {"seconds": result.metrics["train_runtime"], "steps": result.global_step, "technique": "grpo",
            "completion_length": statistics.fmean(m["completion_length"] for m in logs),
            "reward": statistics.fmean(m["reward_mean"] for m in logs)}


def run_trl_grpo(job: str, data: list[dict[str, Any]], args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    weights = job.split("-")[1]
    steps: list[float] = []

    def reward(completions: list[list[dict[str, str]]], answer: list[str], **_: Any) -> list[float]:
        return [1.0 if word.lower() in completion[0]["content"].lower() else 0.0
                for completion, word in zip(completions, answer, strict=True)]

    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2_DIR))
    model = AutoModelForCausalLM.from_pretrained(str(SMOLLM2_DIR), dtype=torch.float32)
    peft = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules="all-linear", task_type="CAUSAL_LM") if weights == "lora" else None
    config = GRPOConfig(
        output_dir=str(folder / "trl"), per_device_train_batch_size=args.batch_size * SAMPLES,
        num_generations=SAMPLES, max_completion_length=COMPLETION, beta=0.0, temperature=1.0, num_train_epochs=1,
        learning_rate=RATES[weights], lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0,
        gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, logging_steps=1, save_strategy="no",
        report_to="none", seed=args.seed, dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=Dataset.from_list(data),
                          processing_class=tokenizer, peft_config=peft, callbacks=[_step_timer(steps)])
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    return {"seconds": sum(steps), "steps": trainer.state.global_step, "technique": "grpo",
            "completion_length": statistics.fmean(e["completions/mean_length"] for e in logged),
            "reward": statistics.fmean(e["reward"] for e in logged)}


def _step_timer(steps: list[float]) -> Any:
    """A TRL callback adding each optimizer step's seconds to `steps` (trainserve's train_runtime counts the same)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        started = 0.0

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            StepTimer.started = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            steps.append(time.perf_counter() - StepTimer.started)

    return StepTimer()


def run_trl(job: str, data: list[dict[str, Any]], args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    method, weights = job.split("-")
    steps: list[float] = []

    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2_DIR))
    model = AutoModelForCausalLM.from_pretrained(str(SMOLLM2_DIR), dtype=torch.float32)
    peft = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules="all-linear", task_type="CAUSAL_LM") if weights == "lora" else None
    common: dict[str, Any] = dict(
        output_dir=str(folder / "trl"), per_device_train_batch_size=args.batch_size, num_train_epochs=1,
        learning_rate=RATES[weights], lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0,
        max_length=args.max_length, gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
        logging_steps=1, save_strategy="no", report_to="none", seed=args.seed, dataloader_num_workers=0,
        disable_tqdm=True)
    dataset = Dataset.from_list(data)
    if method == "sft":
        from trl import SFTConfig, SFTTrainer

        # padding_free leaves max_length to the caller (TRL refuses it otherwise): the rows fit it already.
        layout = {"padding_free": {"padding_free": True, "max_length": None}, "packing": {"packing": True},
                  "padded": {}}[args.trl_sft]
        common = {**common, **layout}
        trainer: Any = SFTTrainer(model=model, args=SFTConfig(**common), train_dataset=dataset,
                                  processing_class=tokenizer, peft_config=peft, callbacks=[_step_timer(steps)])
    else:
        from trl import DPOConfig, DPOTrainer

        trainer = DPOTrainer(model=model, args=DPOConfig(**common, beta=0.1), train_dataset=dataset,
                             processing_class=tokenizer, peft_config=peft, callbacks=[_step_timer(steps)])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"model": lambda: trainer.model, "seconds": sum(steps), "losses": losses,
            "steps": trainer.state.global_step,
            "technique": args.trl_sft if method == "sft" else "padded"}


def _saved_model(folder: Path | None, weights: str) -> Any:
    """The model trainserve saved: the base with the adapter folder, or the full model's folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert folder is not None
    if weights == "full":
        return AutoModelForCausalLM.from_pretrained(str(folder))
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(SMOLLM2_DIR)), str(folder))


def final_loss(model: Any, method: str, data: list[dict[str, Any]], max_length: int) -> float:
    """The trained model's loss over the epoch's rows, one function for both sides: SFT's assistant-token
    cross-entropy (token-weighted), or DPO's loss (beta 0.1) against the untrained base as the reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.engines.training.chat import assistant_loss
    from worker.engines.training.chat_render import collate, render_chat
    from worker.engines.training.dpo import dpo_loss, sequence_logprobs

    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2_DIR))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.eval()
    with torch.no_grad():
        if method == "sft":
            total = weight = 0.0
            for row in data:
                rendered = render_chat(tokenizer, row["prompt"] + row["completion"], max_length=max_length)
                batch = collate([rendered], pad)
                total += assistant_loss(model, None, **batch).item() * rendered.trained_tokens
                weight += rendered.trained_tokens
            return total / weight
        reference = AutoModelForCausalLM.from_pretrained(str(SMOLLM2_DIR)).eval()
        losses = []
        for row in data:
            pair = [collate([render_chat(tokenizer, row["prompt"] + row[key], max_length=max_length)], pad)
                    for key in ("chosen", "rejected")]
            policy = [sequence_logprobs(model, None, b["input_ids"], b["attention_mask"], b["labels"]) for b in pair]
            base = [sequence_logprobs(reference, None, b["input_ids"], b["attention_mask"], b["labels"]) for b in pair]
            losses.append(dpo_loss(policy[0], policy[1], base[0], base[1], 0.1)[0].item())
        return sum(losses) / len(losses)


def measure(side: str, job: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of one side in this (fresh) process."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    method = job.split("-")[0]
    folder = Path(tempfile.mkdtemp(prefix="trl-compare-"))
    if method == "grpo":  # tokens: each sample's prompt and completion, at the side's own completion lengths
        data = prompts(args.rows)
        prompt = prompt_tokens(data)
        Path("/proc/self/clear_refs").write_text("5")
        before = _rss("VmRSS")
        out = (run_trainserve_grpo if side == "trainserve" else run_trl_grpo)(job, data, args, folder)
        tokens = round(len(data) * SAMPLES * (prompt + out["completion_length"]))
        return {"side": side, "job": job, **out, "tokens": tokens, "tokens_per_second": tokens / out["seconds"],
                "peak_gb": (_rss("VmHWM") - before) / 1e9}
    data = rows(method, args.rows, args.longest)
    tokens = epoch_tokens(method, data, args.max_length)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here: the model, the run
    before = _rss("VmRSS")
    out = (run_trainserve if side == "trainserve" else run_trl)(job, data, args, folder)
    peak = _rss("VmHWM") - before
    losses, trained = out.pop("losses"), out.pop("model")
    return {"side": side, "job": job, **out, "tokens": tokens, "tokens_per_second": tokens / out["seconds"],
            "peak_gb": peak / 1e9, "first_loss": losses[0] if losses else None,
            "final_loss": final_loss(trained(), method, data, args.max_length)}


def summarize(job: str, runs: list[dict[str, Any]]) -> str:
    """'sft-lora: trainserve 812 tok/s (790-830) 1.10 GB, TRL 640 tok/s (...) 1.30 GB: 1.27x tokens/s, 0.85x peak'."""
    def side(name: str) -> tuple[list[float], list[float], list[float]]:
        mine = [r for r in runs if r["side"] == name and r["job"] == job]
        return ([r["tokens_per_second"] for r in mine], [r["peak_gb"] for r in mine],
                [r[QUALITY[job.split("-")[0]]] for r in mine])

    ours, theirs = side("trainserve"), side("trl")
    if not ours[0] or not theirs[0]:
        return f"{job}: incomplete"
    speed = statistics.median(ours[0]) / statistics.median(theirs[0])
    memory = statistics.median(ours[1]) / statistics.median(theirs[1])

    def figures(values: tuple[list[float], list[float], list[float]]) -> str:
        return (f"{statistics.median(values[0]):.0f} tok/s ({min(values[0]):.0f}-{max(values[0]):.0f}), "
                f"{statistics.median(values[1]):.2f} GB, {QUALITY[job.split('-')[0]].replace('_', ' ')} "
                f"{statistics.median(values[2]):.3f}")

    return (f"{job}: trainserve {figures(ours)}; TRL {figures(theirs)}: {speed:.2f}x tokens/s at {memory:.2f}x "
            f"the peak")


def verdict(job: str, runs: list[dict[str, Any]]) -> str:
    """Whether a job met the target: 'met' or what missed it."""
    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["side"] == side and r["job"] == job)

    try:
        speed = median("trainserve", "tokens_per_second") / median("trl", "tokens_per_second")
        memory = median("trainserve", "peak_gb") / median("trl", "peak_gb")
    except statistics.StatisticsError:
        return "not measured"
    missed = [f"{speed:.2f}x tokens/s"] if speed < 1.2 else []
    missed += [f"{memory:.2f}x the peak"] if memory > 1.0 else []
    quality = QUALITY[job.split("-")[0]]
    ours, theirs = median("trainserve", quality), median("trl", quality)
    close = abs(ours - theirs) <= (0.1 if quality == "reward" else 0.05 * theirs)  # a mean reward is noisier
    missed += [] if close else [f"{quality.replace('_', ' ')} {ours:.3f} vs {theirs:.3f}"]
    return f"missed ({', '.join(missed)})" if missed else "met"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="the jobs whose name contains one of these, comma-separated (of "
                        "sft-lora, sft-full, dpo-lora, grpo-lora, grpo-full)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--longest", type=int, default=448, help="words in the longest reply")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--trl-sft", choices=("padding_free", "packing", "padded"), default="padding_free")
    parser.add_argument("--seed", type=int, default=0, help="each side's seed (its data order)")
    parser.add_argument("--allocator", choices=("glibc", "jemalloc"), default="glibc")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # side:job to run in this process
    args = parser.parse_args()
    if args.one:
        side, job = args.one.split(":")
        print(json.dumps(measure(side, job, args)))
        return 0
    build_smollm2()
    jobs = [job for job in JOBS if not args.only or any(part in job for part in args.only.split(","))]
    passed = [a for a in sys.argv[1:] if not a.startswith("--json") and not a.endswith(".json")]
    runs, loads = [], []
    for _ in range(args.repeats):
        for job in jobs:
            for side in ("trainserve", "trl"):
                loads.append(os.getloadavg()[0])
                env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), TRANSFORMERS_VERBOSITY="error",
                           **({"LD_PRELOAD": JEMALLOC} if args.allocator == "jemalloc" else {}))
                done = subprocess.run([sys.executable, __file__, *passed, "--one", f"{side}:{job}"], env=env,
                                      cwd=ROOT, capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"{side} {job} failed: {done.stderr.strip()[-2000:]}", flush=True)
                    continue
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(json.dumps(runs[-1]), flush=True)
    lines = [summarize(job, runs) for job in jobs]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "bench/trl_compare.py",
            "what": "one epoch of chat SFT / DPO of SmolLM2-135M-Instruct on a CPU in fp32, trainserve's recipe vs "
                    "TRL's SFTTrainer / DPOTrainer with the same rows, batch, schedule and LoRA; tokens/s over the "
                    "optimizer steps, resident-set peak above the imports, medians of the rounds (min-max); the loss "
                    "of each side's trained model over the same rows by one function",
            "command": "python bench/trl_compare.py " + " ".join(passed),
            "date": datetime.now(UTC).strftime("%Y-%m-%d"),
            "machine": f"{describe()}, peft {version('peft')}, trl {version('trl')}",
            **provenance("bench/trl_compare.py"),
            "load": f"{min(loads):.1f}-{max(loads):.1f}" if loads else "", "result": "; ".join(lines),
            "target": "at least 1.2x TRL's tokens/s at no more than its peak memory, the same loss (within 5%): "
                      + "; ".join(f"{job} {verdict(job, runs)}" for job in jobs)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
