"""/v1/fine_tuning/alpha/graders run and validate through the official openai client: OpenAI's result shape, a
multi grader's sub-rewards, a served tiny chat model as a score_model judge (structured output), and refusals."""

from __future__ import annotations

import json

import openai
import pytest
from rapidfuzz import fuzz

from tests.api.test_chat import served  # noqa: F401 - a tiny chat model served in-process


@pytest.fixture()
def api(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=client.headers["Authorization"].split()[1],
                         http_client=client, max_retries=0)


CHECK = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
         "operation": "eq"}
FUZZY = {"type": "text_similarity", "name": "fuzzy", "input": "{{sample.output_text}}",
         "reference": "{{item.answer}}", "evaluation_metric": "fuzzy_match"}


def test_run_a_string_check_and_a_multi_grader(api):
    result = api.fine_tuning.alpha.graders.run(grader=CHECK, model_sample="Paris", item={"answer": "Paris"})
    assert result.reward == 1.0 and result.metadata.name == "exact" and result.metadata.type == "string_check"
    assert result.metadata.errors.invalid_variable_error is False and result.sub_rewards == {}
    multi = {"type": "multi", "name": "both", "graders": {"exact": CHECK, "fuzzy": FUZZY},
             "calculate_output": "0.25 * exact + 0.75 * fuzzy"}
    result = api.fine_tuning.alpha.graders.run(grader=multi, model_sample="Pariss", item={"answer": "Paris"})
    assert result.reward == pytest.approx(0.75 * fuzz.ratio("Pariss", "Paris") / 100)
    assert result.sub_rewards == {"exact": 0.0, "fuzzy": pytest.approx(fuzz.ratio("Pariss", "Paris") / 100)}
    missing = api.fine_tuning.alpha.graders.run(grader=CHECK, model_sample="Paris", item={})
    assert missing.reward == 0.0 and missing.metadata.errors.invalid_variable_error is True
    # A formula that parses but cannot be computed is the grade's error flag, never a server error.
    for formula, flagged in (("round(fuzzy * 10, exact)", False), ("log(exact)", True), ("exact % 0", True),
                             ("10 ** 400", True)):
        graded = api.fine_tuning.alpha.graders.run(grader={**multi, "calculate_output": formula},
                                                   model_sample="Pariss", item={"answer": "Paris"})
        assert graded.metadata.errors.formula_parse_error is flagged, formula
        assert graded.reward == (0.0 if flagged else round(fuzz.ratio("Pariss", "Paris") / 10)), formula


def test_validate_answers_the_grader_and_refuses_what_cannot_run(api):
    assert api.fine_tuning.alpha.graders.validate(grader=FUZZY).grader.evaluation_metric == "fuzzy_match"
    for grader, words in [
        ({"type": "python", "name": "p", "source": "def grade(sample, item): return 1.0"}, "no client code"),
        ({**FUZZY, "evaluation_metric": "meteor"}, "meteor"),
        ({"type": "multi", "name": "m", "graders": {"a": CHECK}, "calculate_output": "__import__('os')"},
         "calculate_output"),
        ({"type": "multi", "name": "m", "graders": {"a": CHECK}, "calculate_output": "abs(a, a)"}, "takes 1"),
        ({"type": "multi", "name": "m", "graders": {"a": CHECK}, "calculate_output": "min + a"}, "as a value"),
    ]:
        with pytest.raises(openai.UnprocessableEntityError) as bad:
            api.fine_tuning.alpha.graders.validate(grader=grader)
        error = bad.value.body
        assert words in error["message"] and error["param"].startswith("grader"), error


def test_a_served_chat_model_judges_with_structured_output(api, served):  # noqa: F811
    judge = {"type": "score_model", "name": "judge", "model": "chat", "range": [0, 10],
             "sampling_params": {"max_completions_tokens": 24, "seed": 1},
             "input": [{"role": "user", "content": "Q: {{item.q}}\nA: {{sample.output_text}}\nScore it."}]}
    result = api.fine_tuning.alpha.graders.run(grader=judge, model_sample="Paris", item={"q": "Capital of France?"})
    errors = result.metadata.errors
    assert errors.model_grader_server_error is False, errors
    usage = result.model_grader_token_usage_per_model["chat"]
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 24
    # A random tiny model, constrained to {"result": <a number in the range>}: a score, unless cut short.
    assert errors.model_grader_parse_error is False
    if errors.truncated_observation_error:
        assert result.reward == 0.0
    else:
        assert 0 <= result.reward <= 10
    unknown = api.fine_tuning.alpha.graders.run(grader={**judge, "model": "nope"}, model_sample="x", item={"q": "?"})
    assert unknown.metadata.errors.model_grader_server_error is True
    assert "not found" in unknown.metadata.errors.api_model_grader_server_error_details
    assert json.loads(unknown.model_dump_json())["reward"] == 0.0
