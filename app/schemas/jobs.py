"""Job schemas: what clients send and what dashboards poll."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.adapters import AdapterConfig

# JobCreate, the request body: a union of the registered kinds' specs, discriminated by `task` (core.jobspec).
from core.jobspec import INT32_MAX as INT32_MAX
from core.jobspec import JobCreate as JobCreate
from core.jobspec import MethodConfig, ModelConfigValue
from core.rows import JobStatus


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
    adapter: AdapterConfig | None = Field(None, description="LoRA settings, when the job trains an adapter.")
    method: MethodConfig | None = Field(None, description="causal-lm: sft, dpo or reinforcement, with its settings.")
    devices: int
    nodes: int
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
