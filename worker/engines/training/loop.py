"""The one training loop: a recipe supplies model, data order, loss, evaluation and saving; the loop does the rest.

run(config, recipe) reads top to bottom: resolve the device, seed, build the recipe's model and an AdamW,
resume from the latest checkpoint, then per optimizer step: learning rate from a pure schedule, forward
and backward over the step's micro-batches (halving them after an out-of-memory error), clip, step,
log; evaluate every N steps (a new best of `metric_for_best` is checkpointed at once; `early_stopping_patience`
evaluations without one, or a callback's stop reason, end the run early), checkpoint every M steps (pruning all
but the latest and the best); stop (after a checkpoint) when asked. At the end evaluate once more, put the best
evaluation's weights back and let the recipe save the model with its manifest. On several devices (`dist`, one
process each) the same loop runs on every rank with its share of each step (see worker.engines.training.distributed);
rank 0 alone reports, evaluates, decides an early stop (the others follow it) and saves. A sharded model
(worker.engines.training.sharded) needs every rank in each evaluation, checkpoint and the final save.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from core.hyperparams import weight_shards
from core.vocab import EventKind
from worker.engines.device import DevicePlan, is_out_of_memory, release_memory, resolve_device
from worker.engines.models import manifest as manifests
from worker.engines.training import artifacts
from worker.engines.training.best import BestTracker
from worker.engines.training.distributed import Dist, Replica, WholeReplica, join
from worker.engines.training.dropout import use_fast_dropout
from worker.engines.training.loop_helpers import (
    build_adamw,
    check_config,
    checkpoint_due,
    fit_memory,
    lr_at,
    seed_everything,
    split_micro_batches,
    use_checkpointing,
)
from worker.engines.training.loop_types import (
    MAX_GRAD_NORM,
    DoesNotFit,
    OutOfMemory,
    Progress,
    Recipe,
    RunConfig,
    Setup,
    TrainCallbacks,
    TrainResult,
)
from worker.engines.training.sharded import ShardedReplica
from worker.engines.training.sparse_adamw import clip_gradients
from worker.engines.training.tabular_data import steps_per_epoch

# The loop's public names, importable from here as before the split (callers, recipes, tests, benchmarks).
__all__ = ["MAX_GRAD_NORM", "DoesNotFit", "OutOfMemory", "Progress", "RunConfig", "Setup", "Recipe", "TrainCallbacks",
           "TrainResult", "build_adamw", "checkpoint_due", "evaluate", "fit_memory", "lr_at", "run",
           "split_micro_batches", "train_step", "use_checkpointing"]


def run(config: RunConfig, recipe: Recipe, callbacks: TrainCallbacks | None = None, dist: Dist | None = None
        ) -> TrainResult:
    """Run (or resume) a training job to completion or cancellation; `dist` when this process is one rank of many."""
    check_config(config)
    state = _Run(config, recipe, callbacks or TrainCallbacks(), dist)
    state.resume()
    if state.should_stop():  # cancelled while loading: nothing new to checkpoint
        return state.cancelled()
    planned_epoch, steps = -1, list[Sequence[Any]]()
    stop_reason = "completed"
    state.model.train()
    while state.progress.step < state.total_steps:
        epoch, index = divmod(state.progress.step, state.per_epoch)
        if epoch != planned_epoch:
            planned_epoch, steps = epoch, list(recipe.epoch_steps(epoch))
        state.optimizer_step(list(steps[index]))
        eval_due = (config.eval_steps is not None and state.progress.step < state.total_steps
                    and state.progress.step % config.eval_steps == 0)
        improved = state.evaluate_now() if eval_due else None
        # A new best is checkpointed at once: it is what the job will serve, so a resume must find it.
        checkpointed = bool(improved) or checkpoint_due(state.progress.step, config.checkpoint_steps)
        if checkpointed:
            state.save_checkpoint()
        if improved and state.tracker is not None:
            state.callbacks.on_best(state.progress.step, state.tracker.best() or {})
        reason = state.early_stop(evaluated=improved is not None) if eval_due else None
        if reason is not None:
            stop_reason = reason
            break
        if state.should_stop():
            if not checkpointed:
                state.save_checkpoint()
            return state.cancelled()
    return state.finish(stop_reason)


class _Run:
    """One run's state between the steps of run(): device, model, optimizer, schedule, progress, best tracker."""

    def __init__(self, config: RunConfig, recipe: Recipe, callbacks: TrainCallbacks, dist: Dist | None) -> None:
        self.config, self.recipe, self.callbacks = config, recipe, callbacks
        self.plan = (resolve_device(config.device, config.precision, training=True) if dist is None
                     else join(dist, config.device, config.precision))
        self.main = dist is None or dist.is_main
        self.world = 1 if dist is None else dist.world_size
        seed_everything(config.seed)  # the same on every rank: the same head init and the same step plan
        self.setup = recipe.build(self.plan)
        self.model = model = self.setup.model
        if self.plan.device_type == "cpu":
            use_fast_dropout(model)  # PyTorch's CPU dropout masks cost ~10% of a step (worker.engines.training.dropout)
            if dist is None:  # looked-up rows only: see training/sparse_adamw.py (DDP reduces dense gradients)
                for table in self.setup.sparse_tables:
                    table.sparse = table.weight.requires_grad
        # A recipe whose ranks run different numbers of forwards in a step says `shardable = False`.
        shards = weight_shards(config.sharding, self.world, shardable=getattr(recipe, "shardable", True))
        self.sharded = None if dist is None or shards == 1 else ShardedReplica(dist, model, self.plan)
        self.replica: Replica | None = self.sharded or (None if dist is None else WholeReplica(dist, model, self.plan))
        # A checkpoint resumes only at the world size it was written with (the runs' RNG streams differ).
        self.identity = dict(self.setup.identity, world_size=self.world) if self.world > 1 else self.setup.identity
        self.optimizer = build_adamw(model, learning_rate=config.learning_rate, weight_decay=config.weight_decay,
                                     betas=recipe.adam_betas, plan=self.plan)
        self.scaler = self.plan.grad_scaler(sharded=self.sharded is not None)
        self.per_epoch = steps_per_epoch(self.setup.num_examples, config.batch_size,
                                         config.gradient_accumulation_steps)
        self.total_steps = config.max_steps or math.ceil(config.epochs * self.per_epoch)
        self.warmup_steps = math.ceil(config.warmup_ratio * self.total_steps)
        self.progress = Progress(recipe.unit)
        self.tracker = None if config.metric_for_best is None else BestTracker(
            config.metric_for_best, config.greater_is_better, config.early_stopping_patience,
            config.early_stopping_threshold)
        self.split = 1  # each planned micro-batch runs as this many smaller ones after an out-of-memory error

    def resume(self) -> None:
        """Load the latest checkpoint (if any) and tell the callbacks the run starts."""
        config, recipe, world, resumed_from = self.config, self.recipe, self.world, None
        checkpoint = artifacts.latest_checkpoint(config.checkpoint_dir)
        if checkpoint is not None:
            sharded, model, optimizer = self.sharded, self.model, self.optimizer
            restore = None if sharded is None else lambda path: sharded.restore(model, optimizer, path)
            state = artifacts.resume_state(checkpoint, model, optimizer, self.scaler, self.plan, self.identity,
                                           restore)
            if state.get("world_size", 1) != world:
                raise ValueError(f"{checkpoint} was written by a run on {state.get('world_size', 1)} device(s), "
                                 f"this one has {world}; resume it with the same number of devices")
            self.progress = Progress(recipe.unit, step=state["step"], loss_sum=state["loss_sum"],
                                     units=state[recipe.unit], runtime=state["runtime"])
            if self.tracker is not None:
                self.tracker.restore(state.get("best"))
            resumed_from = self.progress.step
            self.callbacks.on_event(EventKind.RESUMED, f"resumed from {checkpoint.name} at step {self.progress.step}")
        # Each node reads its own copy of the checkpoints (pulled from the store): all must resume the same step.
        if self.replica is not None and self.replica.from_main(resumed_from) != resumed_from:
            raise ValueError(f"rank {self.replica.dist.rank} resumed at step {resumed_from}, rank 0 elsewhere; "
                             "its host's checkpoints differ from the head's")
        plan = self.plan
        self.callbacks.on_start({
            "total_steps": self.total_steps, "steps_per_epoch": self.per_epoch, "warmup_steps": self.warmup_steps,
            **self.setup.info, "device": plan.device if world == 1 else f"{plan.device_type} x{world}",
            "world_size": world, "sharded": self.sharded is not None, "precision": plan.precision,
            "resumed_from_step": resumed_from,
            "checkpoint_steps": config.checkpoint_steps})

    def optimizer_step(self, micro_batches: list[Any]) -> None:
        """One optimizer step (halving the micro-batches after an out-of-memory error), then on_log."""
        progress, plan = self.progress, self.plan
        lr = lr_at(progress.step, self.total_steps, self.warmup_steps, self.config.learning_rate)
        started = time.perf_counter()
        while True:
            try:
                loss, grad_norm, examples = train_step(self.model, self.optimizer, self.scaler, plan, self.recipe,
                                                       split_micro_batches(micro_batches, self.split), lr,
                                                       self.replica)
                break
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                if self.replica is not None:  # ranks cannot change their micro-batches apart: the peers would wait
                    raise OutOfMemory(f"out of memory on {plan.device} in a run on {self.world} devices; lower "
                                      "batch_size (and raise gradient_accumulation_steps)") from exc
                self.split = _back_off(exc, micro_batches, self.split, self.optimizer, plan, self.callbacks)
        progress.runtime += time.perf_counter() - started
        progress.step += 1
        progress.loss_sum += loss
        progress.units += examples * self.setup.units_per_example
        # A recipe may report what its step did besides the loss (reinforcement: rewards, KL): `step_metrics()`.
        step_metrics = getattr(self.recipe, "step_metrics", None)
        self.callbacks.on_log(progress.step, progress.step / self.per_epoch, {
            "train_loss": loss, "learning_rate": lr, "grad_norm": grad_norm,
            f"{self.recipe.unit}_per_second": progress.rate, **(step_metrics() if step_metrics else {}),
        })

    def evaluate_now(self) -> bool | None:
        """Evaluate and report (rank 0; a sharded model on every rank); True for a new best, False otherwise, None
        when the recipe has no eval data (and on the other ranks of a whole replica)."""
        if not self.main and self.sharded is None:
            return None
        eval_metrics = evaluate(self.recipe, self.model, self.plan, sharded=self.sharded is not None)
        improved = None if eval_metrics is None or not self.main else self.evaluated(eval_metrics)
        if self.sharded is not None and self.sharded.agree(bool(improved)) and not self.main:
            return True  # every rank takes part in writing rank 0's new best checkpoint
        return improved

    def evaluated(self, eval_metrics: dict[str, float]) -> bool:
        """Report an evaluation; True when it is the new best (the caller checkpoints it)."""
        self.callbacks.on_eval(self.progress.step, eval_metrics)
        return self.tracker is not None and self.tracker.update(self.progress.step, eval_metrics)

    def early_stop(self, *, evaluated: bool) -> str | None:
        """After an evaluation: why the run ends now (patience exhausted, the callbacks' reason), or None."""
        tracker, reason = self.tracker, None
        if evaluated:
            exhausted = tracker is not None and tracker.exhausted
            reason = EventKind.EARLY_STOPPING if exhausted else self.callbacks.stop_reason()
        if self.replica is not None and self.replica.agree(reason is not None) and reason is None:
            reason = "stopped_by_rank_0"  # the other ranks follow rank 0's early stop
        if reason is not None and self.main:
            self.callbacks.on_event(reason, _stop_message(reason, self.progress.step, tracker))
        return reason

    def save_checkpoint(self) -> None:
        """Write a checkpoint of this step (rank 0), keeping the best one through the rotation."""
        # Whole replicas hold the same weights and optimizer state: one writes them; shards are gathered first.
        full = None if self.sharded is None else self.sharded.gather(self.model, self.optimizer)
        if not self.main:
            return
        tracker = self.tracker
        state = dict(self.identity, **self.progress.state(), best=tracker.state() if tracker else None)
        keep = {tracker.step} if tracker is not None and tracker.step is not None else set()
        path = artifacts.save_checkpoint(self.config.checkpoint_dir, self.progress.step, self.model, self.optimizer,
                                         self.scaler, self.plan, state, keep_steps=keep, full=full)
        self.callbacks.on_checkpoint(self.progress.step, path)

    def should_stop(self) -> bool:
        """The callbacks' cancel check (on several ranks: stop when any rank's caller asks)."""
        stop = self.callbacks.should_stop()
        return stop if self.replica is None else self.replica.agree(stop)

    def cancelled(self) -> TrainResult:
        """The result of a cancelled run."""
        self.callbacks.on_event(EventKind.CANCELLED, f"stopped at step {self.progress.step} of {self.total_steps}")
        return TrainResult("cancelled", self.progress.step, self.total_steps, self.progress.metrics(), None, {})

    def finish(self, stop_reason: str) -> TrainResult:
        """Evaluate once more, put the best evaluation's weights back, and let the recipe save the model (rank 0)."""
        progress, tracker, config, sharded = self.progress, self.tracker, self.config, self.sharded
        metrics = progress.metrics()
        if not self.main and sharded is None:  # rank 0 evaluates and saves the one model
            return TrainResult("completed", progress.step, self.total_steps, metrics, None, {},
                               stop_reason=stop_reason)
        # Every rank of a sharded model runs the evaluation, restores the best weights and gathers the final ones.
        eval_metrics = (evaluate(self.recipe, self.model, self.plan, sharded=sharded is not None)
                        if stop_reason == "completed" else None)
        if eval_metrics is not None and self.main:
            self.evaluated(eval_metrics)
            metrics.update(eval_metrics)
        restored = (tracker.step if tracker is not None and tracker.step is not None and tracker.step != progress.step
                    else None)
        if sharded is not None:
            restored = sharded.from_main(restored)
        if restored is not None:
            path = artifacts.checkpoint_path(config.checkpoint_dir, restored)
            if sharded is None:
                artifacts.load_weights(path, self.model, self.plan)
            else:
                sharded.load_weights(self.model, path)
        full = None if sharded is None else sharded.full_model(self.model)
        if not self.main:
            return TrainResult("completed", progress.step, self.total_steps, metrics, None, {},
                               stop_reason=stop_reason)
        if tracker is not None and tracker.step is not None:
            if restored is not None:
                self.callbacks.on_event(EventKind.BEST_RESTORED, f"the model is the best evaluation's: step "
                                        f"{tracker.step}, {tracker.metric}={tracker.value:.4f}")
            metrics.update(tracker.metrics)
        best = tracker.best() if tracker is not None else None
        with artifacts.standing_in(self.model, full):  # a sharded model: rank 0's gathered plain copy is saved
            manifest = self.recipe.save(metrics, self.hyperparameters(), self.plan)
        manifest = dict(manifest, best=best, stop_reason=stop_reason, stopped_at_step=progress.step)
        manifests.write_manifest(config.output_dir, manifest)
        self.callbacks.on_event(EventKind.SAVED, f"model saved to {config.output_dir}")
        return TrainResult("completed", progress.step, self.total_steps, metrics, Path(config.output_dir), manifest,
                           stop_reason=stop_reason, best=best)

    def hyperparameters(self) -> dict[str, Any]:
        """The manifest's resolved hyperparameters: the loop's own, then the recipe's."""
        config = self.config
        return {
            "epochs": self.total_steps / self.per_epoch, "max_steps": config.max_steps,
            "total_steps": self.total_steps, "steps_per_epoch": self.per_epoch, "batch_size": config.batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "learning_rate": config.learning_rate, "lr_schedule": "linear", "warmup_ratio": config.warmup_ratio,
            "warmup_steps": self.warmup_steps, "weight_decay": config.weight_decay, "optimizer": "adamw",
            "adam_betas": list(self.recipe.adam_betas), "max_grad_norm": MAX_GRAD_NORM,
            "precision": self.plan.precision, "seed": config.seed, "eval_steps": config.eval_steps,
            "checkpoint_steps": config.checkpoint_steps, "world_size": self.world,
            "sharding": "fsdp" if self.sharded is not None else "ddp" if self.world > 1 else None,
            "metric_for_best": config.metric_for_best, "early_stopping_patience": config.early_stopping_patience,
            "early_stopping_threshold": config.early_stopping_threshold,
            "sparse_embedding_rows": any(table.sparse for table in self.setup.sparse_tables),
            **self.setup.hyperparameters,
        }


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               plan: DevicePlan, recipe: Recipe, micro_batches: list[Any], lr: float, replica: Replica | None = None
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
                loss = recipe.loss(forward, part)
            share = loss * weight
            scaler.scale(share * scale if scale != 1.0 else share).backward()
        step_loss += share.detach().float()
    if replica is not None:
        step_loss = replica.total(step_loss)
    scaler.unscale_(optimizer)
    # foreach: one multi-tensor norm and scale over all parameters instead of one kernel per tensor.
    # A sparse-row table's gradient counts its looked-up rows (see worker.engines.training.sparse_adamw).
    grad_norm = clip_gradients(model.parameters(), MAX_GRAD_NORM)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return step_loss.item(), float(grad_norm), examples


def evaluate(recipe: Recipe, model: torch.nn.Module, plan: DevicePlan, *, sharded: bool = False
             ) -> dict[str, float] | None:
    """The recipe's eval metrics in eval mode without autograd; the model is back in train mode after."""
    # FSDP reuses its all-gather buffers across forwards, and ones made under inference_mode cannot be written
    # outside it (the next training step would fail): a sharded model evaluates under no_grad.
    model.eval()
    try:
        with torch.inference_mode() if not sharded else torch.no_grad(), plan.autocast():
            return recipe.evaluate()
    finally:
        model.train()


def _back_off(exc: BaseException, micro_batches: list[Any], split: int, optimizer: torch.optim.Optimizer,
              plan: DevicePlan, callbacks: TrainCallbacks) -> int:
    """After an OOM: drop the partial gradients, free the cache, halve the micro-batch (doubling accumulation)."""
    optimizer.zero_grad(set_to_none=True)
    release_memory(plan)
    current = max(len(m) for m in split_micro_batches(micro_batches, split))
    if current <= 1:
        raise OutOfMemory(f"out of memory on {plan.device} with a micro-batch of one example "
                          f"(sequence length too long for this device?): {exc}") from exc
    callbacks.on_event(EventKind.OOM, f"out of memory with micro-batches of {current}; continuing with "
                              f"{math.ceil(current / 2)} and twice the gradient accumulation (same effective batch)")
    return split * 2


def _stop_message(reason: str, step: int, tracker: BestTracker | None) -> str:
    """The event text of an early end: why, and which evaluation the model will be."""
    best = f"; keeping step {tracker.step} ({tracker.metric}={tracker.value:.4f})" if tracker and tracker.best() else ""
    if reason == EventKind.EARLY_STOPPING and tracker is not None:
        return (f"stopped early at step {step}: {tracker.bad_evaluations} evaluations without {tracker.metric} "
                f"improving by more than {tracker.threshold:g}{best}")
    return f"stopped at step {step}: {reason}{best}"
