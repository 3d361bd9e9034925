"""What the training loop exchanges with its callers and recipes: the run's config, callbacks, result, the recipe
protocol, what a recipe builds, and the progress a checkpoint carries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from core.hyperparams import Sharding, TrainingHyperparameters, default
from core.protocol import ErrorCode
from worker.engines.device import DevicePlan

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

    # What a recipe trains: a transformers model, or one wrapped with a LoRA adapter (PEFT forwards the rest).
    TrainedModel = PreTrainedModel | PeftModel


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What every training run shares: data files, outputs, schedule, precision, seed; hyperparameters validated.

    A job's config takes every hyperparameter from its kind's model (training/kinds.py maps them); the defaults
    kept for direct callers are the models' (core.hyperparams): what every kind shares from TrainingHyperparameters
    here, each kind's own in its config (tests/worker/test_engine_configs.py pins them equal).
    """

    train_file: Path
    eval_file: Path | None
    output_dir: Path
    checkpoint_dir: Path
    epochs: float
    max_steps: int | None = default(TrainingHyperparameters, "max_steps")
    batch_size: int
    learning_rate: float
    warmup_ratio: float = default(TrainingHyperparameters, "warmup_ratio")
    weight_decay: float
    gradient_accumulation_steps: int = default(TrainingHyperparameters, "gradient_accumulation_steps")
    precision: str = default(TrainingHyperparameters, "precision")
    seed: int  # each kind's config defaults it to its own model's seed
    eval_steps: int | None = default(TrainingHyperparameters, "eval_steps")
    checkpoint_steps: int | None = None
    metric_for_best: str | None = None  # None: the final model is the last one, nothing tracked
    greater_is_better: bool = False
    # Evaluations without improvement before stopping (None: never); an improvement must exceed the threshold.
    early_stopping_patience: int | None = default(TrainingHyperparameters, "early_stopping_patience")
    early_stopping_threshold: float = default(TrainingHyperparameters, "early_stopping_threshold")
    # None: on only when the run does not fit without it (core.estimate.fitting_memory)
    gradient_checkpointing: bool | None = default(TrainingHyperparameters, "gradient_checkpointing")
    offload_activations: bool = default(TrainingHyperparameters, "offload_activations")
    device: str = "auto"
    devices: int = 1  # processes (one per device) of a data-parallel run on each node; more than one: torchrun
    nodes: int = 1  # hosts of the run (worker.jobs.gang); the world size is nodes x devices
    # fsdp: weights, gradients and AdamW states split over the devices (FSDP2); ddp: a whole replica on each.
    sharding: Sharding = default(TrainingHyperparameters, "sharding")
    memory_limit_bytes: int | None = None  # memory this run may use; None: the device's total (RAM on a CPU)
    base_model_name: str = ""
    dataset_hashes: Mapping[str, str] = field(default_factory=dict)


MAX_GRAD_NORM = 1.0


class TrainCallbacks:
    """Progress hooks and the cancel check; the defaults do nothing."""

    def on_start(self, info: dict[str, Any]) -> None:
        """Called once before the first step with sizes, labels, device and resume point."""

    def on_log(self, step: int, epoch: float, metrics: dict[str, float]) -> None:
        """Called after every optimizer step with train_loss, learning_rate and throughput."""

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Called after each evaluation with the recipe's eval metrics (eval_loss and more)."""

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
    """What a recipe has built for the loop: the model on its device and the facts the loop reports."""

    model: torch.nn.Module
    num_examples: int  # training examples (rows or blocks) in one epoch
    units_per_example: int  # what throughput counts per example: 1 sample, or block_size tokens
    identity: dict[str, Any]  # what a checkpoint must match to be resumed by this run
    info: dict[str, Any]  # recipe facts for on_start (sizes, labels, block size)
    hyperparameters: dict[str, Any]  # recipe-specific entries of the manifest's hyperparameters
    # Embedding tables a batch looks up a few rows of: updated from sparse gradients where the loop can
    # (one process on a CPU), with dense AdamW's result (worker.engines.training.sparse_adamw).
    sparse_tables: tuple[torch.nn.Embedding, ...] = ()


class Recipe(Protocol):
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
