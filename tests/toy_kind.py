"""A job kind shipped outside the package, as TRAINSERVE_JOB_KIND_MODULES loads one: its one declaration, registered
here at import, naming its spec and admission checks (here: all the API needs, no torch) and its engine entry in
tests.toy_engine, which only workers import.

The toy kind fits words per text from characters per text with one linear unit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from core.errors import ValidationFailed
from core.hyperparams import TrainingHyperparameters
from core.jobspec import JobKind, JobSpec, register

if TYPE_CHECKING:
    from core.rows import Dataset
    from core.settings import Settings

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


def admit(settings: Settings, spec: ToyJob, train: Dataset, evaluation: Dataset | None,
          base_path: str | None) -> dict[str, Any]:
    """The toy kind's admission checks: it fits a length, so a label column is refused; it trains a fresh unit
    (no base model path) and has no labels."""
    if spec.label_column is not None:
        raise ValidationFailed("label_column", f"{TOY} jobs fit a text's length; they take no label_column")
    return {"base_model_path": None, "labels": []}


KIND = register(JobKind(ToyJob, {"eval_loss": False, "eval_mae": False}, admission="tests.toy_kind:admit",
                        engine="tests.toy_engine:ENGINE", holds_out_eval=True))
