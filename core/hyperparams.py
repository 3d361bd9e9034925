"""Training hyperparameters: each kind's typed model, the one place their ranges and defaults live.

The API validates a request into these models (core.jobspec), the job row stores the model's JSON, the worker
validates the row's back into the model and maps every field onto the engine's config (worker.engines.training.kinds); a
default an engine config keeps for direct callers is the model's (`default`), so each kind has one set.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Precision = Literal["auto", "fp16", "bf16", "fp32"]
# How a multi-device job spreads the model: fsdp shards weights, gradients and AdamW states over the devices
# (FSDP2), ddp keeps a whole replica on each (DistributedDataParallel); auto is fsdp where the job can shard.
Sharding = Literal["auto", "fsdp", "ddp"]


def default(model: type[BaseModel], name: str) -> Any:
    """The default of one field of a hyperparameters model (an engine config's default, where it keeps one)."""
    return model.model_fields[name].get_default(call_default_factory=True)


def _learning_rate(value: float) -> Any:
    return Field(value, gt=0, le=1, description="Peak AdamW learning rate.")


def _weight_decay(value: float) -> Any:
    return Field(value, ge=0, le=1, description="AdamW decoupled weight decay.")


class TrainingHyperparameters(BaseModel):
    """What every training job takes (schedule, optimizer, precision); each task adds its own and its defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_steps: int | None = Field(None, ge=1, le=10_000_000, description="Optimizer steps; overrides epochs.")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Fraction of steps with linear warmup.")
    gradient_accumulation_steps: int = Field(1, ge=1, le=1024, description="Micro-batches per optimizer step.")
    precision: Precision = Field(
        "auto", description="auto: bf16/fp16 on CUDA by capability; CPU bf16 autocast if calibrated faster, else fp32.")
    eval_steps: int | None = Field(None, ge=1, le=10_000_000, description="Evaluate every N steps (and at the end).")
    metric_for_best: str = Field(
        "eval_loss", min_length=1, max_length=64,
        description="Eval metric that picks the best evaluation, whose weights become the job's model.")
    early_stopping_patience: int | None = Field(
        None, ge=1, le=10_000, description="Stop after this many evaluations without improvement; null: never.")
    early_stopping_threshold: float = Field(
        0.0, ge=0, le=1e6, description="An improvement must exceed this to count for early stopping.")
    gradient_checkpointing: bool | None = Field(
        None, description="Recompute each layer's activations during backward instead of keeping them (about a third "
        "more compute per step, a fraction of the activation memory); null: on only when the job would not fit "
        "its device without it.")
    offload_activations: bool = Field(
        False, description="With gradient checkpointing, hold the layer inputs it keeps in host memory (on a GPU "
        "this frees layers x tokens x hidden values of device memory and costs a copy each way).")

    @model_validator(mode="after")
    def _offload_needs_checkpointing(self) -> TrainingHyperparameters:
        if self.offload_activations and self.gradient_checkpointing is False:
            raise ValueError("offload_activations keeps gradient checkpointing's layer inputs: it needs "
                             "gradient_checkpointing true or null")
        return self
    sharding: Sharding = Field(
        "auto", description="A job on several devices: fsdp splits weights, gradients and AdamW states over them "
        "(FSDP2; fits models one device cannot hold); ddp keeps a whole copy on each (faster for small models); "
        "auto: fsdp, except for reinforcement (ddp).")


class Hyperparameters(TrainingHyperparameters):
    """Hyperparameters of a text-classification fine-tune; unknown keys are rejected."""

    epochs: float = Field(3.0, gt=0, le=100, description="Passes over the training set.")
    batch_size: int = Field(32, ge=1, le=1024, description="Examples per micro-batch.")
    learning_rate: float = _learning_rate(5e-5)
    weight_decay: float = _weight_decay(0.01)
    max_length: int = Field(128, ge=8, le=8192, description="Tokens per example after truncation.")
    seed: int = Field(42, ge=0, le=2**32 - 1, description="Seed for shuffling, dropout and the head init.")
    freeze_word_embeddings: bool = Field(
        False, description="Keep the base model's token-embedding table as it is (faster steps; pretrained bases).")


class LMHyperparameters(TrainingHyperparameters):
    """Hyperparameters of a causal-LM (GPT-2) training job; unknown keys are rejected."""

    epochs: float = Field(1.0, gt=0, le=1000, description="Passes over the training blocks.")
    batch_size: int = Field(8, ge=1, le=1024, description="Blocks per micro-batch.")
    block_size: int | None = Field(None, ge=8, le=32768, description="Tokens per sequence (default min(ctx, 256)).")
    learning_rate: float = _learning_rate(3e-4)
    weight_decay: float = _weight_decay(0.1)
    seed: int = Field(42, ge=0, le=2**32 - 1, description="Seed for init, block order and dropout.")
    val_fraction: float = Field(0.1, gt=0, lt=0.5, description="Held-out share of tokens when no eval dataset.")


def weight_shards(sharding: Sharding, devices: int, *, shardable: bool = True) -> int:
    """How many parts a run's weights, gradients and AdamW states are split into: its devices under fsdp, else 1.

    `shardable` is False for training whose ranks run different numbers of forward passes in a step (reinforcement
    samples answers of different lengths): every forward of a sharded model gathers its weights from all ranks
    together, so such a run keeps whole replicas; asking it for fsdp is a ValueError.
    """
    if sharding == "fsdp" and not shardable:
        raise ValueError("this job cannot shard its weights (its devices run different numbers of forward passes "
                         "in a step); use sharding ddp or auto")
    return devices if devices > 1 and shardable and sharding != "ddp" else 1
