"""Running a grader on one sample: the score, whether it passed, and OpenAI's error flags and metadata.

`grade` never raises for what a sample or a model did: a template naming a missing variable, a judge's
unparseable answer, a failing model call, a formula dividing by zero each set their flag and score 0, as
OpenAI's graders report them. Only a grader that does not validate is refused (core.graders.spec).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from core.graders.checks import schema_errors
from core.graders.formula import evaluate, parse_formula
from core.graders.models import ModelCallFailed, Models
from core.graders.similarity import cosine, text_metric
from core.graders.spec import (
    JsonSchemaGrader,
    LabelModelGrader,
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)
from core.graders.template import UnknownVariable, render

AnyGrader = (StringCheckGrader | TextSimilarityGrader | ScoreModelGrader | LabelModelGrader | JsonSchemaGrader
             | MultiGrader)
ERROR_FLAGS = ("formula_parse_error", "invalid_variable_error", "model_grader_parse_error",
               "model_grader_refusal_error", "model_grader_server_error", "other_error", "python_grader_runtime_error",
               "python_grader_server_error", "sample_parse_error", "truncated_observation_error",
               "unresponsive_reward_error")


@dataclass
class Grade:
    """One grader's verdict on one sample."""

    name: str
    type: str
    score: float = 0.0
    passed: bool | None = None
    errors: set[str] = field(default_factory=set)
    error_details: str | None = None
    sub_scores: dict[str, float] = field(default_factory=dict)
    token_usage: dict[str, dict[str, int]] = field(default_factory=dict)  # judge model -> tokens
    details: dict[str, Any] = field(default_factory=dict)  # e.g. a label, a judge's raw answer
    execution_time: float = 0.0

    def flags(self) -> dict[str, Any]:
        """OpenAI's `metadata.errors`: every flag, true for those set."""
        out: dict[str, Any] = {flag: flag in self.errors for flag in ERROR_FLAGS}
        out["model_grader_server_error_details"] = self.error_details if "model_grader_server_error" in self.errors \
            else None
        out["python_grader_runtime_error_details"] = None
        out["python_grader_server_error_type"] = None
        return out

    def fail(self, flag: str, details: str) -> Grade:
        self.errors.add(flag)
        self.error_details = details[:1000]
        self.score = 0.0
        return self


def threshold_of(grader: AnyGrader) -> float | None:
    """The score a sample needs to pass: the grader's pass_threshold, else string_check's 1 (a match)."""
    if isinstance(grader, LabelModelGrader):
        return None  # passes by its label
    threshold = grader.pass_threshold
    if threshold is None and isinstance(grader, (StringCheckGrader, JsonSchemaGrader)):
        return 1.0
    return threshold


async def grade(grader: AnyGrader, *, item: dict[str, Any], sample: dict[str, Any], models: Models | None) -> Grade:
    """Grade one sample (`sample` holds output_text, output_json...; `item` the data row)."""
    started = time.perf_counter()
    result = Grade(name=grader.name, type=grader.type)
    namespaces = {"item": item, "sample": sample}
    try:
        await _grade(grader, namespaces, models, result)
    except UnknownVariable as exc:
        result.fail("invalid_variable_error", str(exc))
    except ModelCallFailed as exc:
        result.fail("model_grader_server_error", str(exc))
    if not result.errors and not isinstance(grader, LabelModelGrader):
        threshold = threshold_of(grader)
        result.passed = None if threshold is None else result.score >= threshold
    elif result.errors:
        result.passed = False
    result.execution_time = time.perf_counter() - started
    return result


async def _grade(grader: AnyGrader, namespaces: dict[str, Any], models: Models | None, result: Grade) -> None:
    if isinstance(grader, StringCheckGrader):
        result.score = float(_string_check(grader.operation, render(grader.input, namespaces),
                                           render(grader.reference, namespaces)))
    elif isinstance(grader, TextSimilarityGrader):
        text, reference = render(grader.input, namespaces), render(grader.reference, namespaces)
        if grader.evaluation_metric == "cosine":
            vectors = await _models(models).embed(grader.embedding_model, [text, reference])
            result.score = cosine(vectors[0], vectors[1])
        else:
            result.score = text_metric(grader.evaluation_metric, text, reference)
    elif isinstance(grader, JsonSchemaGrader):
        problem = schema_errors(render(grader.input, namespaces), grader.schema_)
        result.score = 1.0 if problem is None else 0.0
        if problem is not None:
            result.details["reason"] = problem
    elif isinstance(grader, (ScoreModelGrader, LabelModelGrader)):
        await _judge(grader, namespaces, _models(models), result)
    else:
        await _multi(grader, namespaces, models, result)


def _string_check(operation: str, text: str, reference: str) -> bool:
    if operation == "eq":
        return text == reference
    if operation == "ne":
        return text != reference
    if operation == "like":
        return reference in text
    return reference.lower() in text.lower()


def _models(models: Models | None) -> Models:
    if models is None:
        raise ModelCallFailed("this grader calls a served model, and none is available here")
    return models


def judge_schema(grader: ScoreModelGrader | LabelModelGrader) -> dict[str, Any]:
    """The structured output the judge must answer with: `{"result": ...}`."""
    if isinstance(grader, ScoreModelGrader):
        low, high = grader.bounds()
        result: dict[str, Any] = {"type": "number", "minimum": low, "maximum": high}
    else:
        result = {"type": "string", "enum": list(grader.labels)}
    return {"type": "object", "properties": {"result": result}, "required": ["result"], "additionalProperties": False}


def judge_instruction(grader: ScoreModelGrader | LabelModelGrader) -> str:
    """The system message that tells the judge how to answer."""
    if isinstance(grader, ScoreModelGrader):
        low, high = grader.bounds()
        return f'Answer with JSON {{"result": <a number from {low:g} to {high:g}>}} and nothing else.'
    return f'Answer with JSON {{"result": <one of {json.dumps(list(grader.labels))}>}} and nothing else.'


async def _judge(grader: ScoreModelGrader | LabelModelGrader, namespaces: dict[str, Any], models: Models,
                 result: Grade) -> None:
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": render(m.text(), namespaces)}
                for m in grader.input]
    messages.append({"role": "system", "content": judge_instruction(grader)})
    sampling = grader.sampling_params if isinstance(grader, ScoreModelGrader) else None
    reply = await models.chat(grader.model, messages, schema=judge_schema(grader), sampling=sampling)
    usage = result.token_usage.setdefault(grader.model, {"prompt_tokens": 0, "completion_tokens": 0,
                                                         "total_tokens": 0})
    usage["prompt_tokens"] += reply.prompt_tokens
    usage["completion_tokens"] += reply.completion_tokens
    usage["total_tokens"] += reply.prompt_tokens + reply.completion_tokens
    result.details["judge_output"] = reply.text
    try:
        answer = json.loads(reply.text)["result"]
    except (ValueError, KeyError, TypeError):
        flag = "truncated_observation_error" if reply.truncated else "model_grader_parse_error"
        result.fail(flag, f"the judge's answer is not {{\"result\": ...}}: {reply.text[:200]!r}")
        return
    if isinstance(grader, LabelModelGrader):
        if answer not in grader.labels:
            result.fail("model_grader_parse_error", f"the judge answered {answer!r}, not one of the labels")
            return
        result.details["label"] = answer
        result.passed = answer in grader.passing_labels
        result.score = 1.0 if result.passed else 0.0
        return
    low, high = grader.bounds()
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not low <= answer <= high:
        result.fail("model_grader_parse_error", f"the judge's score {answer!r} is not a number in [{low:g}, {high:g}]")
        return
    result.score = float(answer)


async def _multi(grader: MultiGrader, namespaces: dict[str, Any], models: Models | None, result: Grade) -> None:
    parts = await asyncio.gather(*(grade(inner, item=namespaces["item"], sample=namespaces["sample"], models=models)
                                   for inner in grader.graders.values()  # a python grader never validates
                                   if not isinstance(inner, PythonGrader)))
    for name, part in zip(grader.graders, parts, strict=True):
        result.sub_scores[name] = part.score
        result.errors |= part.errors
        result.error_details = result.error_details or part.error_details
        for model, usage in part.token_usage.items():
            total = result.token_usage.setdefault(model, dict.fromkeys(usage, 0))
            for key, value in usage.items():
                total[key] = total.get(key, 0) + value
    if result.errors:
        result.score = 0.0
        return
    try:
        result.score = evaluate(parse_formula(grader.calculate_output, names=set(grader.graders)), result.sub_scores)
    except (ArithmeticError, ValueError) as exc:
        result.fail("formula_parse_error", f"calculate_output could not be computed: {exc}")
