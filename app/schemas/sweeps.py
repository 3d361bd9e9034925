"""Sweep schemas: a base job, a search space, a parallelism limit and a pruning rule; children and the best."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.schemas.jobs import BestRead, JobCreate

Scalar = int | float | str | bool | None


class ParameterSpec(BaseModel):
    """One hyperparameter's space: `values` (grid or random choice), or a `low`-`high` range (random only)."""

    model_config = ConfigDict(extra="forbid")

    values: list[Scalar] | None = Field(None, min_length=1, max_length=100)
    low: int | float | None = None
    high: int | float | None = None
    log: bool = Field(False, description="Sample the range log-uniformly (low must be positive).")

    @model_validator(mode="after")
    def _one_kind(self) -> ParameterSpec:
        ranged = self.low is not None or self.high is not None
        if (self.values is None) == (not ranged):
            raise ValueError("give either values or low and high")
        if ranged:
            if self.low is None or self.high is None or not self.low < self.high:
                raise ValueError("a range needs low < high")
            if self.log and self.low <= 0:
                raise ValueError("a log range needs low > 0")
        elif self.log:
            raise ValueError("log applies to ranges")
        return self


class PruningSpec(BaseModel):
    """The median stopping rule: stop a child whose best value so far is worse than the others' median."""

    model_config = ConfigDict(extra="forbid")

    rule: Literal["median"] = "median"
    min_evaluations: int = Field(2, ge=1, le=1000, description="Evaluations a child has before it can be pruned.")
    min_trials: int = Field(2, ge=1, le=100, description="Other children that reached the step, for a median.")


class SweepCreate(BaseModel):
    """A hyperparameter search over one base job."""

    model_config = ConfigDict(extra="forbid")

    job: JobCreate = Field(description="The base job, as POST /jobs takes it; each trial overrides hyperparameters.")
    method: Literal["grid", "random"]
    parameters: dict[str, ParameterSpec] = Field(min_length=1, max_length=20,
                                                 description="Hyperparameter name -> its space.")
    count: int | None = Field(None, ge=1, le=1000, description="random: how many trials.")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="random: seed of the sampler (the trials are fixed).")
    parallelism: int = Field(2, ge=1, le=64, description="Children queued or running at once.")
    pruning: PruningSpec | None = Field(default_factory=PruningSpec, description="null: never prune.")


class SweepBest(BaseModel):
    job_id: str
    trial: int
    step: int
    metric: str
    value: float


class SweepTrialRead(BaseModel):
    """One trial: its sampled values and, once created, its child job."""

    index: int
    params: dict[str, Scalar]
    job_id: str | None
    status: str = Field(description="pending until the child is created, then the child's status.")
    stop_reason: str | None
    best: BestRead | None


class SweepRead(BaseModel):
    id: str
    object: Literal["sweep"] = "sweep"
    status: str
    method: str
    parameters: dict[str, ParameterSpec]
    parallelism: int
    metric: str
    greater_is_better: bool
    pruning: PruningSpec | None
    best: SweepBest | None = Field(description="The best child so far (final once the sweep has succeeded).")
    trials: list[SweepTrialRead]
    base_job: dict[str, Any] = Field(serialization_alias="job", description="The base job as submitted.")
    created_at: datetime
    finished_at: datetime | None
    waiting_reason: str | None = Field(None, description="Why no trial starts now although some are left: the "
                                       "tenant is at its job limit (TRAINSERVE_MAX_ACTIVE_JOBS_PER_TENANT).")
