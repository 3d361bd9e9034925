"""Graders: metrics equal their reference implementations on fixed pairs; string checks, templates, judges,
formulas and their error flags; refusals of what the service will not run."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
from nltk.translate.gleu_score import sentence_gleu
from pydantic import ValidationError
from rapidfuzz import fuzz
from rouge_score import rouge_scorer
from sacrebleu import sentence_bleu

from core.graders import GRADER, Grade, JudgeReply, ModelCallFailed, grade, sample_namespace
from core.graders.formula import FormulaError, evaluate, parse_formula
from core.graders.similarity import bleu, fuzzy_match, gleu, lcs_length, rouge_l, rouge_n

PAIRS = [
    ("The cat sat on the mat.", "The cat sat on the mat."),
    ("The cat sat on the mat.", "A cat was sitting on the mat!"),
    ("the quick brown fox jumps over the lazy dog", "a quick brown dog jumps over the lazy fox"),
    ("Paris is the capital of France.", "The capital of France is Paris."),
    ("It costs $3,000.50 (approx.) -- see e-mail", "It costs about $3,000 -- see the e-mail."),
    ("hello", "goodbye"),
    ("", "something"),
    ("Refund issued; order #12345 closed.", "Your refund was issued and order #12345 is closed."),
    ("x y z x y z x y", "x y x y z z"),
    ("Über café naïve — résumé", "uber cafe naive resume"),
    ("one two three four five six seven", "one two three four five six seven eight"),
    ("a", "a a a a"),
]


@pytest.mark.parametrize(("text", "reference"), PAIRS)
def test_metrics_equal_their_reference_implementations(text: str, reference: str) -> None:
    assert fuzzy_match(text, reference) == pytest.approx(fuzz.ratio(text, reference) / 100, abs=1e-9)
    assert bleu(text, reference) == pytest.approx(sentence_bleu(text, [reference]).score / 100, abs=1e-9)
    assert gleu(text, reference) == pytest.approx(sentence_gleu([reference.split()], text.split()), abs=1e-9)
    scorer = rouge_scorer.RougeScorer([f"rouge{n}" for n in range(1, 6)] + ["rougeL"], use_stemmer=False)
    expected = scorer.score(reference, text)
    for n in range(1, 6):
        assert rouge_n(text, reference, n) == pytest.approx(expected[f"rouge{n}"].fmeasure, abs=1e-9)
    assert rouge_l(text, reference) == pytest.approx(expected["rougeL"].fmeasure, abs=1e-9)


def test_lcs_of_long_sequences_matches_the_quadratic_definition() -> None:
    a, b = "abcbdab" * 40, "bdcaba" * 50
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
    assert lcs_length(a, b) == table[-1][-1]


def run(spec: dict[str, Any], output: str, item: dict[str, Any] | None = None, models: Any = None) -> Grade:
    return asyncio.run(grade(GRADER.validate_python(spec), item=item or {}, sample=sample_namespace(output),
                             models=models))


def check(operation: str, reference: str = "{{item.answer}}") -> dict[str, Any]:
    return {"type": "string_check", "name": "c", "input": "{{sample.output_text}}", "reference": reference,
            "operation": operation}


def test_string_check_operations() -> None:
    item = {"answer": "Paris"}
    assert run(check("eq"), "Paris", item).score == 1.0
    assert run(check("eq"), "paris", item).score == 0.0
    assert run(check("ne"), "Lyon", item).score == 1.0
    assert run(check("like"), "It is Paris.", item).score == 1.0
    assert run(check("like"), "it is paris.", item).score == 0.0
    graded = run(check("ilike"), "IT IS PARIS", item)
    assert (graded.score, graded.passed) == (1.0, True)


def test_templates_reach_nested_item_fields_and_the_samples_json() -> None:
    spec = check("eq", "{{item.order.ids.1}}") | {"input": "{{sample.output_json.id}}"}
    assert run(spec, json.dumps({"id": "b7"}), {"order": {"ids": ["a1", "b7"]}}).score == 1.0
    missing = run(check("eq", "{{item.nope}}"), "x", {"answer": "x"})
    assert missing.errors == {"invalid_variable_error"} and missing.score == 0.0 and missing.passed is False
    assert missing.flags()["invalid_variable_error"] is True


def test_json_schema_grader() -> None:
    spec = {"type": "json_schema", "name": "j", "schema": {"type": "object", "required": ["n"],
                                                           "properties": {"n": {"type": "integer"}}}}
    assert run(spec, '{"n": 3}').passed is True
    refused = run(spec, '{"n": "three"}')
    assert refused.passed is False and "integer" in refused.details["reason"]
    assert run(spec, "not json").score == 0.0
    with pytest.raises(ValidationError, match="schema"):
        GRADER.validate_python(spec | {"schema": {"type": "nonsense"}})


class FakeModels:
    """Served models as a test sets them: a judge's canned answer, embeddings by a lookup."""

    def __init__(self, answer: str = "", vectors: dict[str, list[float]] | None = None, fail: bool = False):
        self.answer, self.vectors, self.fail = answer, vectors or {}, fail
        self.calls: list[tuple[str, list[dict[str, str]], dict[str, Any]]] = []

    async def chat(self, model, messages, *, schema, sampling) -> JudgeReply:
        if self.fail:
            raise ModelCallFailed("model 'judge' not found")
        self.calls.append((model, messages, schema))
        return JudgeReply(text=self.answer, prompt_tokens=7, completion_tokens=3)

    async def embed(self, model, texts) -> list[list[float]]:
        return [self.vectors[t] for t in texts]


SCORE = {"type": "score_model", "name": "s", "model": "judge", "range": [0, 10], "pass_threshold": 7,
         "input": [{"role": "system", "content": "Rate the answer."},
                   {"role": "user",
                    "content": [{"type": "input_text", "text": "Q: {{item.q}} A: {{sample.output_text}}"}]}]}


def test_score_model_asks_the_judge_for_structured_output() -> None:
    models = FakeModels(answer='{"result": 8}')
    graded = run(SCORE, "Paris", {"q": "capital?"}, models)
    assert (graded.score, graded.passed) == (8.0, True)
    model, messages, schema = models.calls[0]
    assert model == "judge" and messages[1]["content"] == "Q: capital? A: Paris"
    assert schema["properties"]["result"] == {"type": "number", "minimum": 0, "maximum": 10}
    assert "0 to 10" in messages[-1]["content"]
    assert graded.token_usage == {"judge": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}
    assert run(SCORE, "x", {"q": "?"}, FakeModels(answer='{"result": 11}')).errors == {"model_grader_parse_error"}
    assert run(SCORE, "x", {"q": "?"}, FakeModels(answer="eight")).errors == {"model_grader_parse_error"}
    failed = run(SCORE, "x", {"q": "?"}, FakeModels(fail=True))
    assert failed.errors == {"model_grader_server_error"} and "not found" in failed.flags()[
        "model_grader_server_error_details"]


def test_label_model_passes_by_its_label() -> None:
    spec = {"type": "label_model", "name": "l", "model": "judge", "labels": ["good", "bad"],
            "passing_labels": ["good"], "input": [{"role": "user", "content": "{{sample.output_text}}"}]}
    graded = run(spec, "fine", models=FakeModels(answer='{"result": "good"}'))
    assert (graded.passed, graded.details["label"]) == (True, "good")
    assert run(spec, "fine", models=FakeModels(answer='{"result": "bad"}')).passed is False
    with pytest.raises(ValidationError, match="subset"):
        GRADER.validate_python(spec | {"passing_labels": ["great"]})


def test_cosine_uses_the_embeddings_model() -> None:
    spec = {"type": "text_similarity", "name": "cos", "input": "{{sample.output_text}}", "reference": "b",
            "evaluation_metric": "cosine", "pass_threshold": 0.5}
    graded = run(spec, "a", models=FakeModels(vectors={"a": [1.0, 0.0], "b": [1.0, 1.0]}))
    assert graded.score == pytest.approx(2 ** -0.5) and graded.passed is True


def test_multi_combines_named_graders_by_formula() -> None:
    spec = {"type": "multi", "name": "m", "calculate_output": "0.5 * exact + 0.5 * max(fuzzy, 0) ^ 2",
            "graders": {"exact": check("eq"), "fuzzy": {"type": "text_similarity", "name": "f",
                        "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
                        "evaluation_metric": "fuzzy_match"}}}
    graded = run(spec, "Pariss", {"answer": "Paris"})
    assert graded.sub_scores["exact"] == 0.0
    assert graded.score == pytest.approx(0.5 * fuzz.ratio("Pariss", "Paris") ** 2 / 10_000)
    zero = run(spec | {"calculate_output": "exact / (fuzzy - fuzzy)"}, "Paris", {"answer": "Paris"})
    assert zero.errors == {"formula_parse_error"}
    single = GRADER.validate_python(spec | {"graders": check("eq") | {"name": "only"}, "calculate_output": "only"})
    assert list(single.graders) == ["only"]  # type: ignore[union-attr]


@pytest.mark.parametrize("formula", ["-" * 5000 + "exact", "(" * 500 + "exact" + ")" * 500, "exact" + "+exact" * 150,
                                     "__import__('os').system('id')", "exact.__class__", "[exact]", "exact if 1 else 0",
                                     "lambda: 1", "open('x')", "exact < 1", "max(exact, key=abs)", "unknown + 1"])
def test_formulas_refuse_everything_but_arithmetic(formula: str) -> None:
    with pytest.raises(FormulaError):
        parse_formula(formula, names={"exact"})


@pytest.mark.parametrize("formula", ["round(a, a, a)", "abs(a, a)", "min(a)", "max(b)", "sqrt()", "floor(a, 2)",
                                     "log(a, b, 2)", "exp(a, a)", "ceil(a, b)", "min + 1", "a * round",
                                     "round(log)(a)"])
def test_formulas_with_the_wrong_arguments_are_refused_when_validated(formula: str) -> None:
    with pytest.raises(FormulaError, match="calculate_output"):
        parse_formula(formula, names={"a", "b"})


# A checked formula fails only on arithmetic (flagged on the grade, never an exception the service answers 500 for).
EDGES = ["round(a, a)", "round(a, 1e300)", "round(a, -b)", "round(1e308 * 10)", "log(0)", "log(a, 1)", "log(a, 0)",
         "log(-a)", "sqrt(-a)", "a % 0", "a / 0", "0 ** -1", "(-8) ** 0.5", "10 ** 400", "1e309", "exp(1000)",
         "floor(1e309)", "ceil(-1e309)", "round(1e309)", "9 ** 9 ** 9", "min(a, 1e309) - max(b, 1e309)",
         "1" + "0" * 400, "round(a, 10 ** 20)", "abs(-1e309)", "a ^ 0.5 ^ -3", "-(-(-a))", "floor(a) % 0.0"]


@pytest.mark.parametrize("formula", EDGES)
def test_a_checked_formula_is_a_number_or_an_arithmetic_error(formula: str) -> None:
    tree = parse_formula(formula, names={"a", "b"})
    for scores in ({"a": 0.5, "b": 2.0}, {"a": 0.0, "b": 0.0}, {"a": 1.0, "b": -3.0}):
        try:
            value = evaluate(tree, scores)
        except (ArithmeticError, ValueError):
            continue
        assert math.isfinite(value)


def test_formula_arithmetic() -> None:
    formula = "floor(a * 10) / 10 + sqrt(b) - abs(-1) + 2 ** 2 + log(exp(1)) + min(a, b, 3) % 1"
    tree = parse_formula(formula, names={"a", "b"})
    assert evaluate(tree, {"a": 0.55, "b": 4.0}) == pytest.approx(0.5 + 2 - 1 + 4 + 1 + 0.55)


@pytest.mark.parametrize(("spec", "field"), [
    ({"type": "python", "name": "p", "source": "def grade(s, i): return 1"}, "python"),
    ({"type": "text_similarity", "name": "t", "input": "a", "reference": "b", "evaluation_metric": "meteor"}, "meteor"),
    ({"type": "string_check", "name": "c", "input": "a", "reference": "b", "operation": "regex"}, "operation"),
    ({"type": "score_model", "name": "s", "model": "m", "input": [{"role": "user", "content": "x"}],
      "range": [1, 0]}, "range"),
])
def test_graders_the_service_refuses(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        GRADER.validate_python(spec)
