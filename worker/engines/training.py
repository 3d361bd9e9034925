"""Fine-tune a sequence-classification model: one readable loop with callbacks, cancel and resume."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from worker.engines import artifacts, data
from worker.engines.device import DevicePlan, is_out_of_memory, release_memory, resolve_device

MAX_GRAD_NORM = 1.0


@dataclass(frozen=True)
class TrainConfig:
    """Everything one fine-tuning run needs; paths are local, hyperparameters already validated."""

    base_model: str
    train_file: Path
    eval_file: Path | None
    text_column: str
    label_column: str
    output_dir: Path
    checkpoint_dir: Path
    epochs: float = 3.0
    max_steps: int | None = None
    batch_size: int = 32
    learning_rate: float = 5e-5
    warmup_ratio: float = 0.0
    weight_decay: float = 0.01
    max_length: int = 128
    gradient_accumulation_steps: int = 1
    precision: str = "auto"
    seed: int = 42
    eval_steps: int | None = None
    checkpoint_steps: int | None = None
    device: str = "auto"
    base_model_name: str = ""
    dataset_hashes: Mapping[str, str] = field(default_factory=dict)


class TrainCallbacks:
    """Progress hooks and the cancel check; the defaults do nothing."""

    def on_start(self, info: dict[str, Any]) -> None:
        """Called once before the first step with sizes, labels, device and resume point."""

    def on_log(self, step: int, epoch: float, metrics: dict[str, float]) -> None:
        """Called after every optimizer step with train_loss, learning_rate, samples_per_second."""

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Called after each evaluation with eval_loss, eval_accuracy and eval_f1."""

    def on_checkpoint(self, step: int, path: Path) -> None:
        """Called after a checkpoint folder is complete."""

    def on_event(self, kind: str, message: str) -> None:
        """Called for notable moments (resumed, cancelled, saved) with a human message."""

    def should_stop(self) -> bool:
        """Return True to cancel; checked after every optimizer step."""
        return False


@dataclass(frozen=True)
class TrainResult:
    """How a run ended, its final metrics and (when completed) where the model is."""

    status: str
    global_step: int
    total_steps: int
    metrics: dict[str, float]
    model_dir: Path | None
    manifest: dict[str, Any]


@dataclass
class Progress:
    """Loop state that a checkpoint carries across a resume."""

    unit: str  # what throughput counts: "samples" (classification) or "tokens" (causal LM)
    step: int = 0
    loss_sum: float = 0.0  # sum of per-step train losses, for the run's mean train_loss
    units: int = 0
    runtime: float = 0.0  # seconds spent in training steps only (no eval, loading or saving)

    @property
    def rate(self) -> float:
        """Units per second of training-step time."""
        return self.units / self.runtime if self.runtime else 0.0

    def metrics(self) -> dict[str, float]:
        return {"train_loss": self.loss_sum / max(self.step, 1), f"train_{self.unit}_per_second": self.rate,
                "train_runtime": self.runtime}


def run_steps(*, progress: Progress, total_steps: int, per_epoch: int,
              epoch_steps: Callable[[int], Sequence[Sequence[Any]]],
              step: Callable[[list[Any], float], tuple[float, float, int]], learning_rate: Callable[[int], float],
              evaluate_now: Callable[[], dict[str, float]] | None, eval_steps: int | None,
              checkpoint_steps: int | None, save: Callable[[int], None], optimizer: torch.optim.Optimizer,
              plan: DevicePlan, callbacks: TrainCallbacks) -> bool:
    """The optimizer-step loop both engines share; False when stopped (after a checkpoint), True when done.

    `epoch_steps(epoch)` lists each step's micro-batches, a pure function of the epoch so a resumed run
    skips what it already did; `step(micro_batches, lr)` returns (loss, grad norm, units processed).
    """
    epoch_plan: tuple[int, Sequence[Sequence[Any]]] | None = None
    split = 1  # each planned micro-batch runs as this many smaller ones after an out-of-memory error
    while progress.step < total_steps:
        epoch, index = divmod(progress.step, per_epoch)
        if epoch_plan is None or epoch_plan[0] != epoch:
            epoch_plan = (epoch, epoch_steps(epoch))
        lr = learning_rate(progress.step)

        started = time.perf_counter()
        while True:
            try:
                loss, grad_norm, units = step(split_micro_batches(list(epoch_plan[1][index]), split), lr)
                break
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                split = _back_off(exc, list(epoch_plan[1][index]), split, optimizer, plan, callbacks)
        progress.runtime += time.perf_counter() - started
        progress.step += 1
        progress.loss_sum += loss
        progress.units += units
        callbacks.on_log(progress.step, progress.step / per_epoch, {
            "train_loss": loss, "learning_rate": lr, "grad_norm": grad_norm,
            f"{progress.unit}_per_second": progress.rate,
        })

        if evaluate_now is not None and eval_steps is not None and progress.step < total_steps \
                and progress.step % eval_steps == 0:
            callbacks.on_eval(progress.step, evaluate_now())
        checkpointed = checkpoint_steps is not None and progress.step % checkpoint_steps == 0
        if checkpointed:
            save(progress.step)
        if callbacks.should_stop():
            if not checkpointed:
                save(progress.step)
            return False
    return True


def lr_at(step: int, total_steps: int, warmup_steps: int, base_lr: float) -> float:
    """Linear warmup then linear decay to zero; `step` counts optimizer steps already taken."""
    if step < warmup_steps:
        return base_lr * step / max(1, warmup_steps)
    return base_lr * max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def train(config: TrainConfig, callbacks: TrainCallbacks | None = None) -> TrainResult:
    """Run (or resume) a fine-tuning job to completion or cancellation."""
    callbacks = callbacks or TrainCallbacks()
    _check_config(config)
    plan = resolve_device(config.device, config.precision)
    seed_everything(config.seed)

    tokenizer = AutoTokenizer.from_pretrained(config.base_model)
    labels, train_set, eval_set = _prepare_data(config, tokenizer)
    model = _load_model(config.base_model, labels)
    model.to(plan.device)  # in place for modules
    optimizer = _build_optimizer(model, config, plan)
    scaler = plan.grad_scaler()

    accumulation = config.gradient_accumulation_steps
    per_epoch = data.steps_per_epoch(len(train_set), config.batch_size, accumulation)
    total_steps = config.max_steps or math.ceil(config.epochs * per_epoch)
    warmup_steps = math.ceil(config.warmup_ratio * total_steps)
    identity = {"num_train": len(train_set), "batch_size": config.batch_size,
                "gradient_accumulation_steps": accumulation, "seed": config.seed, "labels": labels}

    progress, resumed_from = Progress("samples"), None
    checkpoint = artifacts.latest_checkpoint(config.checkpoint_dir)
    if checkpoint is not None:
        progress = _resume(checkpoint, model, optimizer, scaler, plan, identity)
        resumed_from = progress.step
        callbacks.on_event("resumed", f"resumed from {checkpoint.name} at step {progress.step}")
    callbacks.on_start({
        "total_steps": total_steps, "steps_per_epoch": per_epoch, "warmup_steps": warmup_steps,
        "num_train": len(train_set), "num_eval": len(eval_set) if eval_set is not None else 0,
        "labels": labels, "device": plan.device, "precision": plan.precision,
        "resumed_from_step": resumed_from,
    })

    def save(step: int) -> None:
        state = dict(identity, loss_sum=progress.loss_sum, samples=progress.units, runtime=progress.runtime)
        path = artifacts.save_checkpoint(config.checkpoint_dir, step, model, optimizer, scaler, plan, state)
        callbacks.on_checkpoint(step, path)

    def cancelled() -> TrainResult:
        callbacks.on_event("cancelled", f"stopped at step {progress.step} of {total_steps}")
        return TrainResult("cancelled", progress.step, total_steps, progress.metrics(), None, {})

    if callbacks.should_stop():  # cancelled while loading: nothing new to checkpoint
        return cancelled()

    def run_eval() -> dict[str, float]:
        assert eval_set is not None
        return evaluate(model, eval_set, plan, config.batch_size, len(labels))

    completed = run_steps(
        progress=progress, total_steps=total_steps, per_epoch=per_epoch,
        epoch_steps=lambda epoch: data.epoch_steps(train_set.lengths, config.batch_size, accumulation,
                                                   config.seed, epoch),
        step=lambda micro_batches, lr: _train_step(model, optimizer, scaler, plan, train_set, micro_batches, lr),
        learning_rate=lambda step: lr_at(step, total_steps, warmup_steps, config.learning_rate),
        evaluate_now=run_eval if eval_set is not None else None, eval_steps=config.eval_steps,
        checkpoint_steps=config.checkpoint_steps, save=save, optimizer=optimizer, plan=plan, callbacks=callbacks)
    if not completed:
        return cancelled()

    metrics = progress.metrics()
    if eval_set is not None:
        eval_metrics = run_eval()
        callbacks.on_eval(progress.step, eval_metrics)
        metrics.update(eval_metrics)
    manifest = artifacts.build_manifest(
        base_model=str(config.base_model), base_model_name=config.base_model_name, labels=labels,
        hyperparameters=_hyperparameters(config, plan, total_steps, per_epoch, warmup_steps),
        dataset_hashes=dict(config.dataset_hashes), metrics=metrics, plan=plan,
        data={"text_column": config.text_column, "label_column": config.label_column,
              "num_train": len(train_set), "num_eval": len(eval_set) if eval_set is not None else 0},
    )
    artifacts.save_final(config.output_dir, model, tokenizer, manifest)
    callbacks.on_event("saved", f"model saved to {config.output_dir}")
    return TrainResult("completed", progress.step, total_steps, metrics, Path(config.output_dir), manifest)


class OutOfMemory(RuntimeError):
    """The device ran out of memory even with one example per micro-batch."""

    code = "oom"  # the error code the runner records


def split_micro_batches(micro_batches: list[Any], split: int) -> list[Any]:
    """Cut every micro-batch into `split` parts: same examples and optimizer step, less memory at a time."""
    if split == 1:
        return micro_batches
    parts: list[Any] = []
    for indices in micro_batches:
        size = math.ceil(len(indices) / split)
        parts.extend(indices[i:i + size] for i in range(0, len(indices), size))
    return parts


def _back_off(exc: BaseException, micro_batches: list[Any], split: int, optimizer: torch.optim.Optimizer,
              plan: DevicePlan, callbacks: TrainCallbacks) -> int:
    """After an OOM: drop the partial gradients, free the cache, halve the micro-batch (doubling accumulation)."""
    optimizer.zero_grad(set_to_none=True)
    release_memory(plan)
    current = max(len(m) for m in split_micro_batches(micro_batches, split))
    if current <= 1:
        raise OutOfMemory(f"out of memory on {plan.device} with a micro-batch of one example "
                          f"(max_length too long for this device?): {exc}") from exc
    callbacks.on_event("oom", f"out of memory with micro-batches of {current}; continuing with "
                              f"{math.ceil(current / 2)} and twice the gradient accumulation (same effective batch)")
    return split * 2


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                plan: DevicePlan, train_set: data.Encoded, micro_batches: list[list[int]],
                lr: float) -> tuple[float, float, int]:
    """One optimizer step over its micro-batches; returns (mean loss, grad norm, samples)."""
    model.train()
    for group in optimizer.param_groups:
        group["lr"] = lr
    samples = sum(len(indices) for indices in micro_batches)
    step_loss = torch.zeros((), device=plan.device)
    for indices in micro_batches:
        batch = {name: tensor.to(plan.device) for name, tensor in data.collate(train_set, indices).items()}
        with plan.autocast():
            loss = model(**batch).loss
        # Weighting by the micro-batch's share of samples makes the step's gradient the mean over
        # all its samples, exactly what one large batch would give (the last step may be short).
        share = loss * (len(indices) / samples)
        scaler.scale(share).backward()
        step_loss += share.detach().float()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return step_loss.item(), float(grad_norm), samples


def evaluate(model: torch.nn.Module, eval_set: data.Encoded, plan: DevicePlan, batch_size: int,
             num_labels: int) -> dict[str, float]:
    """Loss, accuracy and F1 over the whole eval set (see classification_metrics for which F1)."""
    model.eval()
    predictions = np.empty(len(eval_set), dtype=np.int64)
    loss_sum = 0.0
    with torch.inference_mode(), plan.autocast():
        for indices in data.sorted_batches(eval_set, batch_size):
            batch = {name: tensor.to(plan.device) for name, tensor in data.collate(eval_set, indices).items()}
            labels = batch.pop("labels")
            logits = model(**batch).logits.float()
            loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
            predictions[indices] = logits.argmax(dim=-1).cpu().numpy()
    metrics = {"eval_loss": loss_sum / max(len(eval_set), 1)}
    metrics.update(classification_metrics(predictions, eval_set.label_ids, num_labels))
    return metrics


def classification_metrics(predictions: np.ndarray, targets: np.ndarray, num_labels: int) -> dict[str, float]:
    """Accuracy and F1: binary F1 of label id 1 for two labels, macro F1 over all labels otherwise."""
    accuracy = float(np.mean(predictions == targets)) if len(targets) else 0.0
    classes = [1] if num_labels == 2 else range(num_labels)
    scores = []
    for label in classes:
        true_pos = int(np.sum((predictions == label) & (targets == label)))
        predicted = int(np.sum(predictions == label))
        actual = int(np.sum(targets == label))
        scores.append(2 * true_pos / (predicted + actual) if predicted + actual else 0.0)
    return {"eval_accuracy": accuracy, "eval_f1": float(np.mean(scores))}


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) for a reproducible run."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _check_config(config: TrainConfig) -> None:
    at_least_one = {"batch_size": config.batch_size, "max_length": config.max_length,
                    "gradient_accumulation_steps": config.gradient_accumulation_steps,
                    "max_steps": config.max_steps, "eval_steps": config.eval_steps,
                    "checkpoint_steps": config.checkpoint_steps}
    for name, value in at_least_one.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if config.max_steps is None and not config.epochs > 0:
        raise ValueError(f"epochs must be positive, got {config.epochs}")
    if not 0.0 <= config.warmup_ratio < 1.0:
        raise ValueError(f"warmup_ratio must be in [0, 1), got {config.warmup_ratio}")


def _prepare_data(config: TrainConfig, tokenizer) -> tuple[list[int | str], data.Encoded, data.Encoded | None]:
    examples = data.read_examples(config.train_file, config.text_column, config.label_column)
    labels = data.build_label_map(examples.labels)
    train_ids = data.label_ids_for(examples.labels, labels, "train")
    train_set = data.encode(tokenizer, examples.texts, train_ids, config.max_length)
    eval_set = None
    if config.eval_file is not None:
        held_out = data.read_examples(config.eval_file, config.text_column, config.label_column)
        eval_ids = data.label_ids_for(held_out.labels, labels, "eval")
        eval_set = data.encode(tokenizer, held_out.texts, eval_ids, config.max_length)
    return labels, train_set, eval_set


def _load_model(base_model: str, labels: list[int | str]) -> PreTrainedModel:
    # ignore_mismatched_sizes: a base that is itself a classifier with another label count gets a
    # fresh head instead of a shape error. The attention default is SDPA where the model has it.
    return AutoModelForSequenceClassification.from_pretrained(
        base_model, num_labels=len(labels), id2label={i: str(label) for i, label in enumerate(labels)},
        label2id={str(label): i for i, label in enumerate(labels)}, ignore_mismatched_sizes=True,
        trust_remote_code=False, use_safetensors=True,  # never unpickle a .bin
    )


def build_adamw(model: torch.nn.Module, *, learning_rate: float, weight_decay: float,
                betas: tuple[float, float], plan: DevicePlan) -> torch.optim.Optimizer:
    """AdamW decaying the matrices only: biases and LayerNorm weights (the 1-D parameters) are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    # The fused kernel updates all parameters in one pass; it exists for CPU and CUDA.
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=1e-8,
                             fused=plan.device_type in ("cpu", "cuda"))


def _build_optimizer(model: torch.nn.Module, config: TrainConfig, plan: DevicePlan) -> torch.optim.Optimizer:
    # As BERT and HF Trainer: weights load in fp32, the optimizer keeps fp32 masters, autocast does the rest.
    return build_adamw(model, learning_rate=config.learning_rate, weight_decay=config.weight_decay,
                       betas=(0.9, 0.999), plan=plan)


def _resume(checkpoint: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            scaler: torch.amp.GradScaler, plan: DevicePlan, identity: dict[str, Any]) -> Progress:
    state = artifacts.resume_state(checkpoint, model, optimizer, scaler, plan, identity)
    return Progress("samples", step=state["step"], loss_sum=state["loss_sum"], units=state["samples"],
                    runtime=state["runtime"])


def _hyperparameters(config: TrainConfig, plan: DevicePlan, total_steps: int, per_epoch: int,
                     warmup_steps: int) -> dict[str, Any]:
    return {
        "epochs": total_steps / per_epoch, "max_steps": config.max_steps, "total_steps": total_steps,
        "steps_per_epoch": per_epoch, "batch_size": config.batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "learning_rate": config.learning_rate, "lr_schedule": "linear", "warmup_ratio": config.warmup_ratio,
        "warmup_steps": warmup_steps, "weight_decay": config.weight_decay, "optimizer": "adamw",
        "max_grad_norm": MAX_GRAD_NORM, "max_length": config.max_length, "precision": plan.precision,
        "seed": config.seed, "eval_steps": config.eval_steps, "checkpoint_steps": config.checkpoint_steps,
        "length_grouped": True,
    }
