"""Schemas of OpenAI's platform routes, /v1/files and /v1/fine_tuning/jobs: the shapes openai-python parses.

Requests take OpenAI's fields and, as extra body fields, trainserve's own (`adapter`, `task`, `devices`...);
a method's `hyperparameters` take OpenAI's names ("auto" or a value) and any trainserve hyperparameter by its
own name (`max_steps`, `block_size`, `precision`...). Times are Unix seconds, as OpenAI's are.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, field_validator

from core.adapters import AdapterConfig
from core.jobspec import RegisteredKind
from core.tasks import MAX_JOB_DEVICES
from core.vocab import TaskKind

FilePurpose = Literal["fine-tune", "batch", "batch_output", "evals"]
Auto = Literal["auto"]
JobStatus = Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled"]


class FileObject(BaseModel):
    """An uploaded file: a dataset of trainserve's (the same id under /datasets)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = Field(
        "processed", description="Always processed: an upload is validated row by row before it is stored.")
    expires_at: int | None = None
    status_details: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class SupervisedHyperparameters(BaseModel):
    """OpenAI's hyperparameters ("auto": trainserve's default) plus any trainserve hyperparameter by its name."""

    model_config = ConfigDict(extra="allow")

    batch_size: Auto | Annotated[int, Field(ge=1, le=1024)] = "auto"
    learning_rate_multiplier: Auto | Annotated[float, Field(gt=0, le=1000)] = Field(
        "auto", description="Scales trainserve's default learning rate of the job's kind.")
    n_epochs: Auto | Annotated[int, Field(ge=1, le=1000)] = "auto"

    @field_validator("*", mode="wrap")
    @classmethod
    def _auto_or_value(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # One error at the field itself, not one per member of the union ("auto", the number).
        try:
            return handler(value)
        except ValidationError as exc:
            raise ValueError(f'"auto" or a value: {exc.errors()[-1]["msg"]}') from None


class DpoHyperparameters(SupervisedHyperparameters):
    beta: Auto | Annotated[float, Field(gt=0, le=100)] = "auto"


class ReinforcementHyperparameters(SupervisedHyperparameters):
    """OpenAI's reinforcement hyperparameters; GRPO's own (beta, temperature, loss_type...) by trainserve's name."""

    compute_multiplier: Auto | Annotated[float, Field(gt=0, le=16)] = Field(
        "auto", description="Scales the completions sampled per prompt (trainserve's default group of 4).")
    eval_interval: Auto | Annotated[int, Field(ge=1, le=10_000_000)] = Field(
        "auto", description="Training steps between validation runs (the job's eval_steps).")
    eval_samples: Auto | Annotated[int, Field(ge=1, le=64)] = Field(
        "auto", description="Completions sampled per validation prompt.")
    reasoning_effort: Literal["default", "low", "medium", "high"] | None = Field(
        None, description="Only default: the models trainserve trains have no reasoning-effort setting; bound "
                          "the answers with max_completion_tokens.")


class ReinforcementMethod(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grader: dict[str, Any] = Field(description="The grader whose score is the reward (OpenAI's grader shapes; "
                                               "graders that need a served model are refused).")
    hyperparameters: ReinforcementHyperparameters = Field(default_factory=ReinforcementHyperparameters)


class SupervisedMethod(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hyperparameters: SupervisedHyperparameters = Field(default_factory=SupervisedHyperparameters)


class DpoMethod(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hyperparameters: DpoHyperparameters = Field(default_factory=DpoHyperparameters)


class MethodCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None
    reinforcement: ReinforcementMethod | None = None


class JobEval(BaseModel):
    """A fine-tuning job's eval: run on the base model when the job is created, and on the job once it succeeds.

    `data_source` is a completions data source without `model` (the server names the base, then the job)."""

    model_config = ConfigDict(extra="forbid")

    eval_id: str = Field(min_length=1, max_length=40)
    data_source: dict[str, Any]


class FineTuningJobCreate(BaseModel):
    """OpenAI's fine-tuning job body; trainserve's own options as extra fields. Unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=500, description="The base model: as trainserve's base_model "
                                                                  "(an alias, a model under <home>/models, a job id).")
    training_file: str = Field(min_length=1, max_length=40)
    validation_file: str | None = Field(None, min_length=1, max_length=40)
    hyperparameters: SupervisedHyperparameters | None = Field(
        None, description="Deprecated by OpenAI in favour of method; the supervised method's hyperparameters.")
    method: MethodCreate | None = None
    suffix: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,64}$",
                               description="Up to 64 letters, digits, '.', '_' or '-'; kept on the job.")
    seed: int | None = Field(None, ge=0, le=2**32 - 1)
    metadata: dict[str, str] | None = None
    integrations: list[Any] | None = Field(None, description="Not supported: must be empty.")
    # trainserve's own options (extra body fields of the official clients)
    task: Annotated[str, RegisteredKind] = Field(TaskKind.CAUSAL_LM, description="The job's kind (as POST /jobs).")
    adapter: AdapterConfig | None = Field(None, description="LoRA settings; method dpo without one trains the "
                                                            "default adapter.")
    devices: int = Field(1, ge=1, le=MAX_JOB_DEVICES)
    priority: int = Field(0, ge=-100, le=100)
    text_column: str | None = Field(None, min_length=1, max_length=200)
    label_column: str | None = Field(None, min_length=1, max_length=200)
    eval: JobEval | None = Field(None, description="An eval to run on the base model now and on the fine-tuned "
                                 "model once the job succeeds; the job's events compare the two.")

    @field_validator("integrations")
    @classmethod
    def _no_integrations(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("integrations are not supported; the job's metrics are at GET /jobs/{id}/metrics")
        return value


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class HyperparametersRead(BaseModel):
    """The resolved values (never "auto")."""

    batch_size: int | None = None
    learning_rate_multiplier: float | None = None
    n_epochs: float | None = None
    beta: float | None = None
    compute_multiplier: float | None = None
    eval_interval: int | None = None
    eval_samples: int | None = None


class MethodHyperparameters(BaseModel):
    hyperparameters: HyperparametersRead


class ReinforcementRead(MethodHyperparameters):
    grader: dict[str, Any]


class MethodRead(BaseModel):
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: MethodHyperparameters | None = None
    dpo: MethodHyperparameters | None = None
    reinforcement: ReinforcementRead | None = None


class FineTuningJob(BaseModel):
    """A trainserve job as OpenAI's fine_tuning.job (the same id under /jobs)."""

    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None
    fine_tuned_model: str | None = Field(description="Once succeeded: the model name /v1/chat/completions, "
                                                     "/v1/completions (causal-lm) or /classify accept.")
    finished_at: int | None
    hyperparameters: HyperparametersRead
    model: str
    organization_id: str
    result_files: list[str] = Field(default_factory=list)
    seed: int
    status: JobStatus
    trained_tokens: int | None
    training_file: str | None
    validation_file: str | None
    estimated_finish: int | None
    integrations: list[Any] = Field(default_factory=list)
    metadata: dict[str, str] | None
    method: MethodRead
    user_provided_suffix: str | None = None


class FineTuningJobEvent(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    data: dict[str, Any] | None = None
    type: Literal["message", "metrics"] = "message"


class FineTuningJobCheckpoint(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str = Field(
        description="The best step's: the job's model name; another step's: a name for its checkpoint (download "
                    "it from /jobs/{id}/artifacts while it is kept).")
    fine_tuning_job_id: str
    metrics: dict[str, float] = Field(description="OpenAI's step and valid_loss / full_valid_loss, and every "
                                                  "evaluation metric by trainserve's name.")
    step_number: int


T = TypeVar("T")


class OpenAIList(BaseModel, Generic[T]):
    """OpenAI's cursor page: pass the last object's id as ?after= for the next one while has_more."""

    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None

    @classmethod
    def of(cls, items: list[T], *, has_more: bool) -> OpenAIList[T]:
        """A page of `items` with its first and last ids."""
        ids = [getattr(item, "id", None) for item in items]
        return cls(data=items, has_more=has_more, first_id=ids[0] if ids else None, last_id=ids[-1] if ids else None)


FileList = OpenAIList[FileObject]
FineTuningJobList = OpenAIList[FineTuningJob]
FineTuningJobEventList = OpenAIList[FineTuningJobEvent]
FineTuningJobCheckpointList = OpenAIList[FineTuningJobCheckpoint]
