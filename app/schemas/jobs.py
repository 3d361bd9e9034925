"""Job schemas: what clients send and what dashboards poll."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.rows import JobStatus, TaskKind
from core.tasks import MAX_JOB_DEVICES

INT32_MAX = 2**31 - 1  # steps, event ids and model_config values are 32-bit integer columns or smaller
MAX_NESTING = 16  # deeper JSON in a free-form field cannot be a valid value; refused before it is serialized
ModelConfigValue = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]


def nesting_depth(value: Any) -> int:
    """Depth of nested lists/dicts in a JSON value, level by level without recursion (a scalar is 0)."""
    depth, level = 0, [value]
    while any(isinstance(node, (dict, list)) for node in level):
        depth += 1
        level = [child for node in level if isinstance(node, (dict, list))
                 for child in (node.values() if isinstance(node, dict) else node)]
    return depth


class JobCreate(BaseModel):
    """A training request. Unknown fields are rejected so typos do not pass silently."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    task: TaskKind = TaskKind.TEXT_CLASSIFICATION
    base_model: str | None = Field(
        None, min_length=1, max_length=500,
        description="text-classification: alias (minilm-l6), local folder or hub id (required). "
                    "causal-lm: an existing causal LM to continue from, or omit and give model_config.")
    architecture: dict[str, ModelConfigValue] | None = Field(
        None, alias="model_config",
        description="causal-lm from scratch: GPT-2 shape {n_layer, n_embd, n_head, n_positions}.")
    train_dataset: str = Field(min_length=1, max_length=40)
    eval_dataset: str | None = Field(None, min_length=1, max_length=40)
    text_column: str = Field("text", min_length=1, max_length=200)
    label_column: str | None = Field(None, min_length=1, max_length=200,
                                     description="text-classification only (default 'label').")
    hyperparameters: dict[str, Any] = Field(
        default_factory=dict,
        description="Validated per task: see Hyperparameters (text-classification) and LMHyperparameters.")
    devices: int = Field(
        1, ge=1, le=MAX_JOB_DEVICES,
        description="Devices to train on (DistributedDataParallel, one process each) on one worker that owns at "
                    "least this many; hyperparameters keep their meaning: batch_size is split across them.")
    metadata: dict[str, str] = Field(default_factory=dict, description="Up to 16 string pairs for your own use.")
    priority: int = Field(0, ge=-100, le=100, description="Higher runs first among your team's queued jobs.")

    @field_validator("hyperparameters")
    @classmethod
    def _bounded_nesting(cls, value: dict[str, Any]) -> dict[str, Any]:
        if nesting_depth(value) > MAX_NESTING:
            raise ValueError(f"nested more than {MAX_NESTING} levels deep")
        return value

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > 16:
            raise ValueError("at most 16 keys")
        for key, item in value.items():
            if len(key) > 64 or len(item) > 512:
                raise ValueError("keys are at most 64 characters and values at most 512")
            if "\x00" in key or "\x00" in item:
                raise ValueError("NUL characters are not allowed")
        return value


class Progress(BaseModel):
    step: int
    total_steps: int | None
    epoch: float
    fraction: float


class ArtifactRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    kind: str
    step: int | None
    size_bytes: int
    files: list[str]
    created_at: datetime
    download_url: str


class BestRead(BaseModel):
    """The evaluation whose weights are the job's model."""

    step: int
    metric: str
    value: float


class JobRead(BaseModel):
    id: str
    object: Literal["job"] = "job"
    status: JobStatus
    task: str
    base_model: str | None
    architecture: dict[str, ModelConfigValue] | None = Field(None, serialization_alias="model_config")
    train_dataset: str | None
    eval_dataset: str | None
    text_column: str
    label_column: str | None
    labels: list[Any]
    hyperparameters: dict[str, Any]
    devices: int
    progress: Progress
    eta_seconds: float | None
    metrics: dict[str, float]
    best_metrics: dict[str, float] = Field(
        default_factory=dict, description="Best eval_accuracy/eval_f1 (highest) and eval_loss/perplexity (lowest) "
                                          "so far; in GET /jobs and GET /jobs/{id}.")
    device: str | None
    error: dict[str, Any] | None
    attempts: int
    cancel_requested: bool
    best: BestRead | None = Field(None, description="The best evaluation of metric_for_best; the served model.")
    stop_reason: str | None = Field(
        None, description="Succeeded jobs: completed, early_stopping, or pruned (a sweep's median rule).")
    sweep_id: str | None = None
    artifacts: list[ArtifactRead]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    metadata: dict[str, Any]
    priority: int
    queue_position: int | None = Field(
        None, description="While queued (on GET /jobs/{id}): 1 runs next, if teams keep taking turns.")
    waiting_reason: str | None = Field(None, description="While queued: why it has not started yet.")
    receipt: dict[str, Any] | None = Field(
        None, description="What the job ran with: code and library versions, device, precision, dataset hashes, "
                          "seed, resolved configuration (written when training starts).")
    rerun_of: str | None = Field(None, description="The job this one repeats (POST /jobs/{id}/rerun).")


class Difference(BaseModel):
    field: str = Field(description="Dotted path, e.g. hyperparameters.learning_rate or receipt.libraries.torch.")
    values: list[Any] = Field(description="One value per job, in the order asked (null: absent).")


class JobComparison(BaseModel):
    ids: list[str]
    differences: list[Difference]
    identical: int = Field(description="How many compared fields have the same value in every job.")


class MetricPointRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    step: int
    epoch: float
    name: str
    value: float
    created_at: datetime


class MetricHistory(BaseModel):
    job_id: str
    data: list[MetricPointRead]
    next_since_step: int | None = Field(description="Pass as since_step to continue when the page was full.")
    bucket_steps: int = Field(1, description="Steps per bucket when max_points downsampled the history (1: raw).")


class EventRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    kind: str
    level: str
    message: str
    data: dict[str, Any] | None
    created_at: datetime


class EventList(BaseModel):
    job_id: str
    data: list[EventRead]


class CheckpointRead(BaseModel):
    """One evaluation of a job, with the checkpoint taken there while it is kept (the best and the latest)."""

    id: str
    object: Literal["checkpoint"] = "checkpoint"
    step: int
    metrics: dict[str, float]
    is_best: bool
    created_at: datetime
    artifact_id: str | None = Field(description="Set while the weights of this step can be downloaded.")
    download_url: str | None


class CheckpointList(BaseModel):
    job_id: str
    best: BestRead | None
    data: list[CheckpointRead]
