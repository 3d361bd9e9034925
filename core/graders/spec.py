"""Grader specifications in OpenAI's shapes (openai.types.graders), validated once and used everywhere.

`string_check`, `text_similarity`, `score_model`, `label_model` and `multi` are OpenAI's; `json_schema` is this
server's own (passes when the sample is JSON that a schema accepts). `python` is refused: no client code runs in
the service. An eval's testing criterion is a grader with an optional `pass_threshold`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from core.generation_limits import MAX_TOKENS_BOUND

MAX_TEXT = 20_000  # characters of a template (input, reference, a message)
MAX_NAME = 256
SIMILARITY_METRICS = ("cosine", "fuzzy_match", "bleu", "gleu", "meteor", "rouge_1", "rouge_2", "rouge_3",
                      "rouge_4", "rouge_5", "rouge_l")
UNSUPPORTED_METRICS = {"meteor": "meteor needs WordNet synonyms, which this server does not ship; use bleu, gleu, "
                                 "rouge_* or fuzzy_match"}

Text = Annotated[str, Field(max_length=MAX_TEXT)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name


class StringCheckGrader(_Spec):
    """1.0 when `input` and `reference` compare as `operation` says (like: contains; ilike: ignoring case)."""

    type: Literal["string_check"]
    input: Text
    reference: Text
    operation: Literal["eq", "ne", "like", "ilike"]
    pass_threshold: float | None = None


class TextSimilarityGrader(_Spec):
    """A similarity in [0, 1] between `input` and `reference` by `evaluation_metric`."""

    type: Literal["text_similarity"]
    input: Text
    reference: Text
    evaluation_metric: Literal["cosine", "fuzzy_match", "bleu", "gleu", "meteor", "rouge_1", "rouge_2", "rouge_3",
                               "rouge_4", "rouge_5", "rouge_l"]
    pass_threshold: float | None = None
    # This server's own: the served embeddings model for `cosine` (OpenAI picks its own).
    embedding_model: Annotated[str, Field(min_length=1, max_length=200)] | None = None

    @field_validator("evaluation_metric")
    @classmethod
    def _supported(cls, value: str) -> str:
        if value in UNSUPPORTED_METRICS:
            raise ValueError(UNSUPPORTED_METRICS[value])
        return value


class ContentPart(BaseModel):
    """A text part of a judge's message (images and audio are not supported)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text"]
    text: Text


class JudgeMessage(BaseModel):
    """One message of a judge's prompt; its text may hold {{item.*}} and {{sample.*}} references."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant", "system", "developer"]
    content: Text | ContentPart | list[ContentPart]
    type: Literal["message"] | None = None

    def text(self) -> str:
        """The message's text, its parts joined."""
        if isinstance(self.content, str):
            return self.content
        parts = self.content if isinstance(self.content, list) else [self.content]
        return "".join(part.text for part in parts)


class JudgeSampling(BaseModel):
    """The judge's sampling parameters (OpenAI's spelling, max_completions_tokens included)."""

    model_config = ConfigDict(extra="ignore")

    max_completions_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None


class ScoreModelGrader(_Spec):
    """A served chat model reads the messages and answers `{"result": <number in range>}`."""

    type: Literal["score_model"]
    input: Annotated[list[JudgeMessage], Field(min_length=1, max_length=32)]
    model: Annotated[str, Field(min_length=1, max_length=200)]
    range: Annotated[list[float], Field(min_length=2, max_length=2)] | None = None
    sampling_params: JudgeSampling | None = None
    pass_threshold: float | None = None

    @field_validator("range")
    @classmethod
    def _ordered(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and not value[0] < value[1]:
            raise ValueError("range is [low, high] with low < high")
        return value

    def bounds(self) -> tuple[float, float]:
        """The score's range, [0, 1] unless given."""
        low, high = self.range or [0.0, 1.0]
        return low, high


class LabelModelGrader(_Spec):
    """A served chat model picks one of `labels`; it passes when the label is one of `passing_labels`."""

    type: Literal["label_model"]
    input: Annotated[list[JudgeMessage], Field(min_length=1, max_length=32)]
    model: Annotated[str, Field(min_length=1, max_length=200)]
    labels: Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]], Field(min_length=1, max_length=100)]
    passing_labels: Annotated[list[str], Field(min_length=1, max_length=100)]

    @model_validator(mode="after")
    def _subset(self) -> LabelModelGrader:
        missing = [label for label in self.passing_labels if label not in self.labels]
        if missing:
            raise ValueError(f"passing_labels must be a subset of labels; {missing[0]!r} is not a label")
        return self


class JsonSchemaGrader(_Spec):
    """1.0 when `input` (the sample's text unless given) is JSON that `schema` accepts (JSON Schema 2020-12)."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")
    input: Text = "{{sample.output_text}}"
    pass_threshold: float | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        from core.graders.checks import check_schema

        check_schema(value)
        return value


class PythonGrader(_Spec):
    """Accepted as a shape so the refusal can name it: the service runs no client code."""

    type: Literal["python"]
    source: str = ""

    @model_validator(mode="after")
    def _refused(self) -> PythonGrader:
        raise ValueError("python graders are not supported: this server runs no client code; combine string_check, "
                         "text_similarity, json_schema and model graders with a multi grader instead")


SimpleGrader = Annotated[StringCheckGrader | TextSimilarityGrader | ScoreModelGrader | LabelModelGrader
                         | JsonSchemaGrader | PythonGrader, Field(discriminator="type")]


class MultiGrader(_Spec):
    """Named graders combined by `calculate_output`, a formula over their scores (core.graders.formula)."""

    type: Literal["multi"]
    graders: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")], SimpleGrader]
    calculate_output: Annotated[str, Field(min_length=1, max_length=2000)]
    pass_threshold: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_grader(cls, data: Any) -> Any:
        # The official client types `graders` as one grader: it is then named by its own name.
        if isinstance(data, dict) and isinstance(data.get("graders"), dict) and "type" in data["graders"]:
            inner = data["graders"]
            data = {**data, "graders": {str(inner.get("name", "grader")): inner}}
        return data

    @model_validator(mode="after")
    def _formula(self) -> MultiGrader:
        from core.graders.formula import parse_formula

        if not self.graders:
            raise ValueError("graders names at least one grader")
        parse_formula(self.calculate_output, names=set(self.graders))
        return self


Grader = Annotated[StringCheckGrader | TextSimilarityGrader | ScoreModelGrader | LabelModelGrader
                   | JsonSchemaGrader | PythonGrader | MultiGrader, Field(discriminator="type")]
GRADER = TypeAdapter(Grader)
