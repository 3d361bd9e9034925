"""OpenAI's /v1/evals, runs and output items, as the official client's `evals` resource reads them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.schemas.fine_tuning import OpenAIList
from core.evals import MAX_CRITERIA, CompletionsDataSource, CustomDataSourceConfig, check_criteria
from core.graders import Grader

Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]


class EvalCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(max_length=256)] | None = None
    data_source_config: CustomDataSourceConfig
    testing_criteria: Annotated[list[Grader], Field(min_length=1, max_length=MAX_CRITERIA)]
    metadata: Metadata | None = None

    @model_validator(mode="after")
    def _criteria(self) -> EvalCreate:
        check_criteria(self.testing_criteria)
        return self


class EvalUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(max_length=256)] | None = None
    metadata: Metadata | None = None


class DataSourceConfigRead(BaseModel):
    type: Literal["custom"] = "custom"
    schema_: dict[str, Any] = Field(serialization_alias="schema")


class EvalObject(BaseModel):
    object: Literal["eval"] = "eval"
    id: str
    name: str
    created_at: int
    data_source_config: DataSourceConfigRead
    testing_criteria: list[dict[str, Any]]
    metadata: dict[str, str] | None = None


class EvalDeleted(BaseModel):
    object: Literal["eval.deleted"] = "eval.deleted"
    deleted: bool = True
    eval_id: str


class RunCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(max_length=256)] | None = None
    data_source: CompletionsDataSource
    metadata: Metadata | None = None


class ResultCounts(BaseModel):
    total: int
    passed: int
    failed: int
    errored: int


class CriterionResult(BaseModel):
    testing_criteria: str
    passed: int
    failed: int


class ModelUsage(BaseModel):
    model_name: str
    invocation_count: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int


class EvalRunObject(BaseModel):
    object: Literal["eval.run"] = "eval.run"
    id: str
    eval_id: str
    name: str
    model: str
    status: str
    created_at: int
    data_source: dict[str, Any]
    result_counts: ResultCounts
    per_testing_criteria_results: list[CriterionResult]
    per_model_usage: list[ModelUsage]
    report_url: str
    error: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    batch_id: str | None = None  # this server's own: the /v1/batches batch that generates the samples
    job_id: str | None = None  # this server's own: the fine-tuning job whose eval this is
    role: Literal["base", "fine_tuned"] | None = None


class RunDeleted(BaseModel):
    object: Literal["eval.run.deleted"] = "eval.run.deleted"
    deleted: bool = True
    run_id: str


class OutputItemObject(BaseModel):
    object: Literal["eval.run.output_item"] = "eval.run.output_item"
    id: str
    run_id: str
    eval_id: str
    created_at: int
    status: str
    datasource_item_id: int
    datasource_item: dict[str, Any]
    results: list[dict[str, Any]]
    sample: dict[str, Any]


EvalList = OpenAIList[EvalObject]
EvalRunList = OpenAIList[EvalRunObject]
OutputItemList = OpenAIList[OutputItemObject]
