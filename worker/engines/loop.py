"""The one training loop: a task supplies model, data order, loss, evaluation and saving; the loop does the rest.

run(config, task) reads top to bottom: resolve the device, seed, build the task's model and an AdamW,
resume from the latest checkpoint, then per optimizer step: learning rate from a pure schedule, forward
and backward over the step's micro-batches (halving them after an out-of-memory error), clip, step,
log; evaluate every N steps (a new best of `metric_for_best` is checkpointed at once; `early_stopping_patience`
evaluations without one, or a callback's stop reason, end the run early), checkpoint every M steps (pruning all
but the latest and the best); stop (after a checkpoint) when asked. At the end evaluate once more, put the best
evaluation's weights back and let the task save the model with its manifest. On several devices (`dist`, one
process each) the same loop runs on every rank with its share of each step (see worker.engines.distributed);
rank 0 alone reports, evaluates, decides an early stop (the others follow it) and saves.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from core.estimate import MemoryEstimate, format_bytes
from core.protocol import ErrorCode
from worker.engines import artifacts
from worker.engines.best import BestTracker
from worker.engines.data import steps_per_epoch
from worker.engines.device import DevicePlan, device_memory, is_out_of_memory, release_memory, resolve_device
from worker.engines.distributed import Dist, Replica, join
from worker.engines.dropout import use_fast_dropout
from worker.engines.sparse_rows import RowSparseAdamW, clip_gradients

MAX_GRAD_NORM = 1.0


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What every training run shares: data files, outputs, schedule, precision, seed; hyperparameters validated."""

    train_file: Path
    eval_file: Path | None
    output_dir: Path
    checkpoint_dir: Path
    epochs: float
    max_steps: int | None = None
    batch_size: int
    learning_rate: float
    warmup_ratio: float = 0.0
    weight_decay: float
    gradient_accumulation_steps: int = 1
    precision: str = "auto"
    seed: int = 42
    eval_steps: int | None = None
    checkpoint_steps: int | None = None
    metric_for_best: str | None = None  # None: the final model is the last one, nothing tracked
    greater_is_better: bool = False
    early_stopping_patience: int | None = None  # evaluations without improvement before stopping; None: never
    early_stopping_threshold: float = 0.0  # an improvement must exceed this to reset the patience
    device: str = "auto"
    devices: int = 1  # processes (one per device) of a data-parallel run; more than one runs under torchrun
    memory_limit_bytes: int | None = None  # memory this run may use; None: the device's total (RAM on a CPU)
    base_model_name: str = ""
    dataset_hashes: Mapping[str, str] = field(default_factory=dict)


class TrainCallbacks:
    """Progress hooks and the cancel check; the defaults do nothing."""

    def on_start(self, info: dict[str, Any]) -> None:
        """Called once before the first step with sizes, labels, device and resume point."""

    def on_log(self, step: int, epoch: float, metrics: dict[str, float]) -> None:
        """Called after every optimizer step with train_loss, learning_rate and throughput."""

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Called after each evaluation with the task's eval metrics (eval_loss and more)."""

    def on_checkpoint(self, step: int, path: Path) -> None:
        """Called after a checkpoint folder is complete."""

    def on_best(self, step: int, best: dict[str, Any]) -> None:
        """Called when an evaluation is the new best ({step, metric, value}), after its checkpoint is written."""

    def stop_reason(self) -> str | None:
        """Return a reason (e.g. "pruned") to end the run early as completed; checked after each evaluation."""
        return None

    def on_event(self, kind: str, message: str) -> None:
        """Called for notable moments (resumed, oom, cancelled, saved) with a human message."""

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
    stop_reason: str | None = None  # completed runs: "completed", "early_stopping" or the callbacks' reason
    best: dict[str, Any] | None = None  # {step, metric, value} of the evaluation whose weights were saved


class OutOfMemory(RuntimeError):
    """The device ran out of memory even with one example per micro-batch."""

    code = ErrorCode.OOM


class DoesNotFit(ValueError):
    """The run's estimated peak memory exceeds this worker's device; refused before allocating the model."""

    code = ErrorCode.DOES_NOT_FIT


@dataclass(frozen=True)
class Setup:
    """What a task has built for the loop: the model on its device and the facts the loop reports."""

    model: torch.nn.Module
    num_examples: int  # training examples (rows or blocks) in one epoch
    units_per_example: int  # what throughput counts per example: 1 sample, or block_size tokens
    identity: dict[str, Any]  # what a checkpoint must match to be resumed by this run
    info: dict[str, Any]  # task facts for on_start (sizes, labels, block size)
    hyperparameters: dict[str, Any]  # task-specific entries of the manifest's hyperparameters
    # Embedding tables a batch looks up a few rows of: updated from sparse gradients where the loop can
    # (one process on a CPU), with dense AdamW's result (worker.engines.sparse_rows).
    sparse_tables: tuple[torch.nn.Embedding, ...] = ()


class Task(Protocol):
    """A kind of training (classification, causal LM) as the loop sees it."""

    unit: str  # what throughput counts: "samples" or "tokens"
    adam_betas: tuple[float, float]

    def build(self, plan: DevicePlan) -> Setup:
        """Load tokenizer, data and model (on plan.device); raise DoesNotFit before allocating a model too big."""

    def epoch_steps(self, epoch: int) -> Sequence[Sequence[Any]]:
        """One epoch as optimizer steps of micro-batches; a pure function of the epoch, so a resume can skip."""

    def loss(self, model: torch.nn.Module, micro_batch: Any) -> torch.Tensor:
        """Mean training loss of one micro-batch through `model` (the built one or its DDP wrapper), under autocast."""

    def evaluate(self) -> dict[str, float] | None:
        """Eval metrics over the held-out data (called in eval mode, under inference_mode); None without any."""

    def save(self, metrics: dict[str, float], hyperparameters: dict[str, Any], plan: DevicePlan) -> dict[str, Any]:
        """Write the final model folder with its manifest and return the manifest."""


@dataclass
class Progress:
    """Loop state that a checkpoint carries across a resume."""

    unit: str
    step: int = 0
    loss_sum: float = 0.0  # sum of per-step train losses, for the run's mean train_loss
    units: int = 0
    runtime: float = 0.0  # seconds spent in training steps only (no eval, loading or saving)

    @property
    def rate(self) -> float:
        """Units per second of training-step time."""
        return self.units / self.runtime if self.runtime else 0.0

    def metrics(self) -> dict[str, float]:
        """The run's summary: mean train loss, throughput and time spent training."""
        return {"train_loss": self.loss_sum / max(self.step, 1), f"train_{self.unit}_per_second": self.rate,
                "train_runtime": self.runtime}

    def state(self) -> dict[str, Any]:
        """What a checkpoint stores of this (the units under the unit's own name, as ever)."""
        return {"loss_sum": self.loss_sum, self.unit: self.units, "runtime": self.runtime}


def run(config: RunConfig, task: Task, callbacks: TrainCallbacks | None = None, dist: Dist | None = None
        ) -> TrainResult:
    """Run (or resume) a training job to completion or cancellation; `dist` when this process is one rank of many."""
    callbacks = callbacks or TrainCallbacks()
    check_config(config)
    plan = (resolve_device(config.device, config.precision, training=True) if dist is None
            else join(dist, config.device, config.precision))
    main = dist is None or dist.is_main
    world = 1 if dist is None else dist.world_size
    seed_everything(config.seed)  # the same on every rank: the same head init and the same step plan

    setup = task.build(plan)
    model = setup.model
    if plan.device_type == "cpu":
        use_fast_dropout(model)  # PyTorch's CPU dropout masks cost ~10% of a step (worker.engines.dropout)
        if dist is None:  # looked-up rows only: see worker.engines.sparse_rows (DDP reduces dense gradients)
            for table in setup.sparse_tables:
                table.sparse = table.weight.requires_grad
    replica = None if dist is None else Replica(dist, model, plan)
    # A checkpoint resumes only at the world size it was written with (the runs' RNG streams differ).
    identity = dict(setup.identity, world_size=world) if world > 1 else setup.identity
    optimizer = build_adamw(model, learning_rate=config.learning_rate, weight_decay=config.weight_decay,
                            betas=task.adam_betas, plan=plan)
    scaler = plan.grad_scaler()

    per_epoch = steps_per_epoch(setup.num_examples, config.batch_size, config.gradient_accumulation_steps)
    total_steps = config.max_steps or math.ceil(config.epochs * per_epoch)
    warmup_steps = math.ceil(config.warmup_ratio * total_steps)

    progress, resumed_from = Progress(task.unit), None
    tracker = None if config.metric_for_best is None else BestTracker(
        config.metric_for_best, config.greater_is_better, config.early_stopping_patience,
        config.early_stopping_threshold)
    checkpoint = artifacts.latest_checkpoint(config.checkpoint_dir)
    if checkpoint is not None:
        state = artifacts.resume_state(checkpoint, model, optimizer, scaler, plan, identity)
        if state.get("world_size", 1) != world:
            raise ValueError(f"{checkpoint} was written by a run on {state.get('world_size', 1)} device(s), this "
                             f"one has {world}; resume it with the same number of devices")
        progress = Progress(task.unit, step=state["step"], loss_sum=state["loss_sum"], units=state[task.unit],
                            runtime=state["runtime"])
        if tracker is not None:
            tracker.restore(state.get("best"))
        resumed_from = progress.step
        callbacks.on_event("resumed", f"resumed from {checkpoint.name} at step {progress.step}")
    callbacks.on_start({"total_steps": total_steps, "steps_per_epoch": per_epoch, "warmup_steps": warmup_steps,
                        **setup.info, "device": plan.device if world == 1 else f"{plan.device_type} x{world}",
                        "world_size": world, "precision": plan.precision, "resumed_from_step": resumed_from})

    def save_checkpoint() -> None:
        if not main:  # every rank holds the same weights and optimizer state: one writes them
            return
        state = dict(identity, **progress.state(), best=tracker.state() if tracker else None)
        keep = {tracker.step} if tracker is not None and tracker.step is not None else set()
        path = artifacts.save_checkpoint(config.checkpoint_dir, progress.step, model, optimizer, scaler, plan, state,
                                         keep_steps=keep)
        callbacks.on_checkpoint(progress.step, path)

    def should_stop() -> bool:
        stop = callbacks.should_stop()
        return stop if replica is None else replica.agree(stop)

    def evaluated(eval_metrics: dict[str, float]) -> bool:
        """Report an evaluation; True when it is the new best (the caller checkpoints it)."""
        callbacks.on_eval(progress.step, eval_metrics)
        return tracker is not None and tracker.update(progress.step, eval_metrics)

    def cancelled() -> TrainResult:
        callbacks.on_event("cancelled", f"stopped at step {progress.step} of {total_steps}")
        return TrainResult("cancelled", progress.step, total_steps, progress.metrics(), None, {})

    if should_stop():  # cancelled while loading: nothing new to checkpoint
        return cancelled()

    planned_epoch, steps = -1, list[Sequence[Any]]()
    stop_reason = "completed"
    split = 1  # each planned micro-batch runs as this many smaller ones after an out-of-memory error
    model.train()
    while progress.step < total_steps:
        epoch, index = divmod(progress.step, per_epoch)
        if epoch != planned_epoch:
            planned_epoch, steps = epoch, list(task.epoch_steps(epoch))
        lr = lr_at(progress.step, total_steps, warmup_steps, config.learning_rate)

        started = time.perf_counter()
        while True:
            try:
                loss, grad_norm, examples = train_step(model, optimizer, scaler, plan, task,
                                                       split_micro_batches(list(steps[index]), split), lr, replica)
                break
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                if replica is not None:  # ranks cannot change their micro-batches apart: the peers would wait
                    raise OutOfMemory(f"out of memory on {plan.device} in a run on {world} devices; lower "
                                      "batch_size (and raise gradient_accumulation_steps)") from exc
                split = _back_off(exc, list(steps[index]), split, optimizer, plan, callbacks)
        progress.runtime += time.perf_counter() - started
        progress.step += 1
        progress.loss_sum += loss
        progress.units += examples * setup.units_per_example
        callbacks.on_log(progress.step, progress.step / per_epoch, {
            "train_loss": loss, "learning_rate": lr, "grad_norm": grad_norm,
            f"{task.unit}_per_second": progress.rate,
        })

        eval_due = (config.eval_steps is not None and progress.step < total_steps
                    and progress.step % config.eval_steps == 0)
        eval_metrics, improved = None, False
        if main and eval_due:
            eval_metrics = evaluate(task, model, plan)
            improved = eval_metrics is not None and evaluated(eval_metrics)
        # A new best is checkpointed at once: it is what the job will serve, so a resume must find it.
        periodic = config.checkpoint_steps is not None and progress.step % config.checkpoint_steps == 0
        checkpointed = improved or periodic
        if checkpointed:
            save_checkpoint()
        if improved and tracker is not None:
            callbacks.on_best(progress.step, tracker.best() or {})
        if eval_due:
            reason = None
            if eval_metrics is not None:
                reason = "early_stopping" if tracker is not None and tracker.exhausted else callbacks.stop_reason()
            if replica is not None and replica.agree(reason is not None) and reason is None:
                reason = "stopped_by_rank_0"  # the other ranks follow rank 0's early stop
            if reason is not None:
                stop_reason = reason
                if main:
                    callbacks.on_event(reason, _stop_message(reason, progress.step, tracker))
                break
        if should_stop():
            if not checkpointed:
                save_checkpoint()
            return cancelled()

    metrics = progress.metrics()
    if not main:  # rank 0 evaluates and saves the one model
        return TrainResult("completed", progress.step, total_steps, metrics, None, {}, stop_reason=stop_reason)
    eval_metrics = evaluate(task, model, plan) if stop_reason == "completed" else None
    if eval_metrics is not None:
        evaluated(eval_metrics)
        metrics.update(eval_metrics)
    if tracker is not None and tracker.step is not None:
        if tracker.step != progress.step:
            artifacts.load_weights(artifacts.checkpoint_path(config.checkpoint_dir, tracker.step), model, plan)
            callbacks.on_event("best_restored", f"the model is the best evaluation's: step {tracker.step}, "
                                                f"{tracker.metric}={tracker.value:.4f}")
        metrics.update(tracker.metrics)
    hyperparameters = {
        "epochs": total_steps / per_epoch, "max_steps": config.max_steps, "total_steps": total_steps,
        "steps_per_epoch": per_epoch, "batch_size": config.batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps, "learning_rate": config.learning_rate,
        "lr_schedule": "linear", "warmup_ratio": config.warmup_ratio, "warmup_steps": warmup_steps,
        "weight_decay": config.weight_decay, "optimizer": "adamw", "adam_betas": list(task.adam_betas),
        "max_grad_norm": MAX_GRAD_NORM, "precision": plan.precision, "seed": config.seed,
        "eval_steps": config.eval_steps, "checkpoint_steps": config.checkpoint_steps, "world_size": world,
        "metric_for_best": config.metric_for_best, "early_stopping_patience": config.early_stopping_patience,
        "early_stopping_threshold": config.early_stopping_threshold,
        "sparse_embedding_rows": any(table.sparse for table in setup.sparse_tables), **setup.hyperparameters,
    }
    best = tracker.best() if tracker is not None else None
    manifest = task.save(metrics, hyperparameters, plan)
    manifest = dict(manifest, best=best, stop_reason=stop_reason, stopped_at_step=progress.step)
    artifacts.write_manifest(config.output_dir, manifest)
    callbacks.on_event("saved", f"model saved to {config.output_dir}")
    return TrainResult("completed", progress.step, total_steps, metrics, Path(config.output_dir), manifest,
                       stop_reason=stop_reason, best=best)


def _stop_message(reason: str, step: int, tracker: BestTracker | None) -> str:
    """The event text of an early end: why, and which evaluation the model will be."""
    best = f"; keeping step {tracker.step} ({tracker.metric}={tracker.value:.4f})" if tracker and tracker.best() else ""
    if reason == "early_stopping" and tracker is not None:
        return (f"stopped early at step {step}: {tracker.bad_evaluations} evaluations without {tracker.metric} "
                f"improving by more than {tracker.threshold:g}{best}")
    return f"stopped at step {step}: {reason}{best}"


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               plan: DevicePlan, task: Task, micro_batches: list[Any], lr: float, replica: Replica | None = None
               ) -> tuple[float, float, int]:
    """One optimizer step over its micro-batches (a rank's share of them); returns (mean loss, grad norm, examples)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    examples = sum(len(micro_batch) for micro_batch in micro_batches)
    # Weighting by the micro-batch's share of examples makes the step's gradient the mean over all
    # of them, exactly what one large batch would give (the last step of an epoch may be short).
    if replica is None:
        parts, weights, forward, scale = micro_batches, [len(m) / examples for m in micro_batches], model, 1.0
    else:
        (parts, weights), forward, scale = replica.share(micro_batches), replica.module, replica.gradient_scale
    step_loss = torch.zeros((), device=plan.device)
    for i, (part, weight) in enumerate(zip(parts, weights, strict=True)):
        with contextlib.nullcontext() if replica is None else replica.sync_unless(last=i == len(parts) - 1):
            with plan.autocast():
                loss = task.loss(forward, part)
            share = loss * weight
            scaler.scale(share * scale if scale != 1.0 else share).backward()
        step_loss += share.detach().float()
    if replica is not None:
        step_loss = replica.total(step_loss)
    scaler.unscale_(optimizer)
    # foreach: one multi-tensor norm and scale over all parameters instead of one kernel per tensor.
    # A sparse-row table's gradient counts its looked-up rows (see worker.engines.sparse_rows).
    grad_norm = clip_gradients(model.parameters(), MAX_GRAD_NORM)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return step_loss.item(), float(grad_norm), examples


def evaluate(task: Task, model: torch.nn.Module, plan: DevicePlan) -> dict[str, float] | None:
    """The task's eval metrics in eval mode without autograd; the model is back in train mode after."""
    model.eval()
    try:
        with torch.inference_mode(), plan.autocast():
            return task.evaluate()
    finally:
        model.train()


def lr_at(step: int, total_steps: int, warmup_steps: int, base_lr: float) -> float:
    """Linear warmup then linear decay to zero; `step` counts optimizer steps already taken."""
    if step < warmup_steps:
        return base_lr * step / max(1, warmup_steps)
    return base_lr * max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) for a reproducible run."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_adamw(model: torch.nn.Module, *, learning_rate: float, weight_decay: float,
                betas: tuple[float, float], plan: DevicePlan) -> torch.optim.Optimizer:
    """AdamW decaying the matrices only: biases and LayerNorm weights (the 1-D parameters) are not decayed."""
    # Weights stay fp32 (as BERT, nanoGPT and HF Trainer): the optimizer keeps fp32 masters, autocast does
    # the rest. Embeddings are matrices and decay too (GPT-2 ties wte to the LM head, so they are one).
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    # The fused kernel updates all parameters in one pass; it exists for CPU and CUDA. Tables with sparse
    # gradients take RowSparseAdamW's row step, with the same result as dense AdamW.
    return RowSparseAdamW(groups, lr=learning_rate, betas=betas, eps=1e-8, fused=plan.device_type in ("cpu", "cuda"))


def require_fit(estimate: MemoryEstimate | None, plan: DevicePlan, limit: int | None) -> None:
    """Refuse, before the model is allocated, a run whose estimated peak memory exceeds this device."""
    if estimate is None:
        return
    capacity = limit or device_memory(plan)
    if estimate.total_bytes > capacity:
        raise DoesNotFit(f"this job needs about {estimate.describe()}, more than {plan.device} on this worker "
                         f"has ({format_bytes(capacity)}); lower batch_size (and raise gradient_accumulation_steps "
                         "for the same effective batch) or the sequence length, or use a smaller model")


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
                          f"(sequence length too long for this device?): {exc}") from exc
    callbacks.on_event("oom", f"out of memory with micro-batches of {current}; continuing with "
                              f"{math.ceil(current / 2)} and twice the gradient accumulation (same effective batch)")
    return split * 2


def check_config(config: RunConfig) -> None:
    """Refuse a schedule that cannot run (counts below one, no epochs, warmup of the whole run)."""
    at_least_one = {"batch_size": config.batch_size,
                    "gradient_accumulation_steps": config.gradient_accumulation_steps,
                    "max_steps": config.max_steps, "eval_steps": config.eval_steps,
                    "checkpoint_steps": config.checkpoint_steps,
                    "early_stopping_patience": config.early_stopping_patience}
    for name, value in at_least_one.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if config.max_steps is None and not config.epochs > 0:
        raise ValueError(f"epochs must be positive, got {config.epochs}")
    if not 0.0 <= config.warmup_ratio < 1.0:
        raise ValueError(f"warmup_ratio must be in [0, 1), got {config.warmup_ratio}")
