"""Fine-tuning hyperparameters: validated ranges and defaults, shared by the API and the worker."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Precision = Literal["auto", "fp16", "bf16", "fp32"]


class Hyperparameters(BaseModel):
    """Hyperparameters of a text-classification fine-tune; unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    epochs: float = Field(3.0, gt=0, le=100, description="Passes over the training set.")
    max_steps: int | None = Field(None, ge=1, le=10_000_000, description="Optimizer steps; overrides epochs.")
    batch_size: int = Field(32, ge=1, le=1024, description="Examples per micro-batch.")
    learning_rate: float = Field(5e-5, gt=0, le=1, description="Peak AdamW learning rate.")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Fraction of steps with linear warmup.")
    weight_decay: float = Field(0.01, ge=0, le=1, description="AdamW decoupled weight decay.")
    max_length: int = Field(128, ge=8, le=8192, description="Tokens per example after truncation.")
    gradient_accumulation_steps: int = Field(1, ge=1, le=1024, description="Micro-batches per optimizer step.")
    precision: Precision = Field("auto", description="auto: bf16/fp16 on CUDA by capability, fp32 on CPU.")
    seed: int = Field(42, ge=0, le=2**32 - 1, description="Seed for shuffling, dropout and the head init.")
    eval_steps: int | None = Field(None, ge=1, le=10_000_000, description="Evaluate every N steps (and at the end).")


class LMHyperparameters(BaseModel):
    """Hyperparameters of a causal-LM (GPT-2) training job; unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    epochs: float = Field(1.0, gt=0, le=1000, description="Passes over the training blocks.")
    max_steps: int | None = Field(None, ge=1, le=10_000_000, description="Optimizer steps; overrides epochs.")
    batch_size: int = Field(8, ge=1, le=1024, description="Blocks per micro-batch.")
    block_size: int | None = Field(None, ge=8, le=32768, description="Tokens per sequence (default min(ctx, 256)).")
    learning_rate: float = Field(3e-4, gt=0, le=1, description="Peak AdamW learning rate.")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Fraction of steps with linear warmup.")
    weight_decay: float = Field(0.1, ge=0, le=1, description="AdamW decoupled weight decay.")
    gradient_accumulation_steps: int = Field(1, ge=1, le=1024, description="Micro-batches per optimizer step.")
    precision: Precision = Field("auto", description="auto: bf16/fp16 on CUDA by capability, fp32 on CPU.")
    seed: int = Field(42, ge=0, le=2**32 - 1, description="Seed for init, block order and dropout.")
    eval_steps: int | None = Field(None, ge=1, le=10_000_000, description="Evaluate every N steps (and at the end).")
    val_fraction: float = Field(0.1, gt=0, lt=0.5, description="Held-out share of tokens when no eval dataset.")
