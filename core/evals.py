"""OpenAI's evals: an eval (an item schema and testing criteria) and its runs against a model.

A `completions` run renders each item's messages from a template, runs them as a /v1/batches batch on the
generation workers (paced, fair, resumable: core.batches), and grades each item's sample with the eval's
testing criteria (core.graders) as the batch's parts are stored (worker.batches.grading). An item is graded once: the
(run, item) pair is unique, and a resumed run grades only the items without a row. A run's status follows its batch:

    queued -> in_progress          the batch was created (its task is on the generation queue)
    in_progress -> completed       the batch completed and every item has its grades
    in_progress -> canceled        the run (its batch) was cancelled
    in_progress -> failed          the batch failed or expired
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.batches import CANCELLED, CANCELLING, COMPLETED, EXPIRED, FAILED
from core.errors import ValidationFailed
from core.generation_limits import MAX_TOKENS_BOUND
from core.graders.checks import check_schema
from core.graders.spec import Grader, JudgeMessage, TextSimilarityGrader
from core.graders.template import lookup, render
from core.tabular import TableSummary, json_objects

QUEUED, IN_PROGRESS, RUN_COMPLETED, CANCELED, RUN_FAILED = "queued", "in_progress", "completed", "canceled", "failed"
MAX_ITEMS = 10_000
MAX_CRITERIA = 20


class CustomDataSourceConfig(BaseModel):
    """The items' JSON schema; with include_sample_schema the graders may also read `sample`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["custom"]
    item_schema: dict[str, Any]
    include_sample_schema: bool = False

    @field_validator("item_schema")
    @classmethod
    def _schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_schema(value)
        return value

    def schema_object(self) -> dict[str, Any]:
        """The schema of what graders see, as OpenAI answers it: `item` and (if included) `sample`."""
        properties: dict[str, Any] = {"item": self.item_schema}
        required = ["item"]
        if self.include_sample_schema:
            properties["sample"] = {"type": "object", "properties": {"output_text": {"type": "string"}}}
            required.append("sample")
        return {"type": "object", "properties": properties, "required": required}


def check_criteria(criteria: list[Grader]) -> None:
    """Testing criteria that can decide pass or fail (text_similarity needs a pass_threshold, as OpenAI's do)."""
    names = [c.name for c in criteria]
    for at, criterion in enumerate(criteria):
        if isinstance(criterion, TextSimilarityGrader) and criterion.pass_threshold is None:
            raise ValueError(f"testing_criteria.{at}: a text_similarity criterion needs pass_threshold")
        if names.count(criterion.name) > 1:
            raise ValueError(f"testing_criteria.{at}: the name {criterion.name!r} is used twice; names are unique")


class SourceItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    item: dict[str, Any]
    sample: dict[str, Any] | None = None


class FileContentSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["file_content"]
    content: Annotated[list[SourceItem], Field(min_length=1, max_length=MAX_ITEMS)]


class FileIdSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["file_id"]
    id: Annotated[str, Field(min_length=1, max_length=40)]


class TemplateMessages(BaseModel):
    """Messages rendered per item ({{item.*}} references)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["template"]
    template: Annotated[list[JudgeMessage], Field(min_length=1, max_length=64)]


class ItemReferenceMessages(BaseModel):
    """The messages are a field of the item (e.g. `item.messages`)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["item_reference"]
    item_reference: Annotated[str, Field(min_length=1, max_length=200)]


class CompletionsSampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: int | None = None


class CompletionsDataSource(BaseModel):
    """A file of items, the messages each becomes, and the model (a served name: base, job, adapter) to answer."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["completions"]
    source: Annotated[FileContentSource | FileIdSource, Field(discriminator="type")]
    input_messages: Annotated[TemplateMessages | ItemReferenceMessages, Field(discriminator="type")]
    model: Annotated[str, Field(min_length=1, max_length=200)]
    sampling_params: CompletionsSampling | None = None

    @model_validator(mode="before")
    @classmethod
    def _needs_messages(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("input_messages") is None:
            raise ValueError("input_messages is required: a template of messages, or an item_reference")
        return data


def summarize_eval_items(path: Path, fmt: str, *, max_rows: int | None = None) -> TableSummary:
    """Check an eval's items file (purpose "evals"): JSON Lines of `{"item": {...}}` (and an optional `sample`)."""
    if fmt != "jsonl":
        raise ValidationFailed("file", 'an eval file is JSON Lines (.jsonl): one {"item": {...}} per line')
    count = 0
    with open(path, encoding="utf-8") as text:
        for line_no, record in json_objects(text):
            try:
                SourceItem.model_validate(record)
            except ValidationError as exc:
                raise ValidationFailed("file", f'line {line_no}: each line is {{"item": {{...}}}}: '
                                               f"{exc.errors()[0]['msg']}") from exc
            count += 1
            if max_rows is not None and count > max_rows:
                raise ValidationFailed("file", f"more than {max_rows} items")
    return TableSummary(format="evals", columns=["item", "sample"], rows=count, stats={})


def input_messages(source: CompletionsDataSource, item: dict[str, Any]) -> list[dict[str, str]]:
    """The messages an item becomes ({{item.*}} filled in); ValueError (UnknownVariable) says what is missing."""
    namespaces = {"item": item}
    template = source.input_messages
    if isinstance(template, ItemReferenceMessages):
        value = lookup(template.item_reference, namespaces)
        if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                  for m in value):
            raise ValueError(f"{template.item_reference} is not a list of messages")
        return [{"role": str(m.get("role", "user")), "content": m["content"]} for m in value]
    return [{"role": m.role, "content": render(m.text(), namespaces)} for m in template.template]


def run_status(stored: str, batch_status: str | None, graded: int, total: int) -> str:
    """A run's status from its row and its batch's."""
    if batch_status is None:
        return stored
    if batch_status == COMPLETED:
        return RUN_COMPLETED if graded >= total else IN_PROGRESS
    if batch_status in (CANCELLING, CANCELLED):
        return CANCELED
    if batch_status in (FAILED, EXPIRED):
        return RUN_FAILED
    return IN_PROGRESS


def items_key(run_id: str) -> str:
    """Where a run's items are kept (JSON Lines of SourceItem, in order)."""
    return f"evals/{run_id}/items.jsonl"
