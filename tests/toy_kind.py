"""A job kind shipped outside the package, as TRAINSERVE_JOB_KIND_MODULES loads one: its spec, registered here at
import (all the API needs: no torch), and its engine in tests.toy_engine, which only workers import.

The toy kind fits words per text from characters per text with one linear unit.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.hyperparams import TrainingHyperparameters
from core.jobspec import JobKind, JobSpec, register

TOY = "text-length"


class ToyHyperparameters(TrainingHyperparameters):
    """The toy kind's hyperparameters and their defaults, in one place."""

    epochs: float = Field(20.0, gt=0, le=100, description="Passes over the training texts.")
    batch_size: int = Field(8, ge=1, le=64, description="Texts per optimizer step.")
    learning_rate: float = Field(0.05, gt=0, le=1, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay.")
    seed: int = Field(7, ge=0, description="Seed of the shuffling and the initial weights.")
    metric_for_best: str = Field("eval_mae", description="The eval metric that picks the best checkpoint.")


class ToyJob(JobSpec):
    """Fit words per text from characters per text."""

    task: Literal["text-length"]
    hyperparameters: ToyHyperparameters = Field(default_factory=ToyHyperparameters)


KIND = register(JobKind(ToyJob, {"eval_loss": False, "eval_mae": False}, holds_out_eval=True,
                        engine_module="tests.toy_engine"))
