"""Decisions the API and the worker both make, each made by one function: precision, cadence, context, SSE, keys,
and the generation limits (each default, bound and cap written once; each refusal naming the field the client sent)."""

from __future__ import annotations

import ast
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.sse import COMPACT, sse_comment, sse_message, sse_retry
from core import redis_keys
from core.capacity import DeviceCapacity
from core.errors import ValidationFailed
from core.generation_limits import (
    CHAT,
    COMPLETIONS,
    EVAL_RUN,
    GENERATE,
    JUDGE,
    MAX_TOKENS_BOUND,
    fit_refusal,
    server_refusal,
)
from core.precision import auto_precision
from core.protocol import SamplingParams
from worker.engines.device import resolve_device
from worker.engines.training.loop import checkpoint_due

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("facts", "expected"), [
    ({"is_cuda": True, "bf16_supported": True}, "bf16"),
    ({"is_cuda": True, "bf16_supported": False}, "fp16"),  # pre-Ampere: the API used to assume bf16 here
    ({"is_cuda": False}, "fp32"),
    ({"is_cuda": False, "cpu_bf16_faster": True}, "bf16"),
])
def test_auto_precision_from_the_device_facts(facts, expected):
    assert auto_precision(**facts) == expected


def test_the_worker_plan_and_the_reported_capacity_agree_with_auto_precision():
    plan = resolve_device("cpu", "auto")  # neither training nor generation: no calibration, fp32
    assert plan.precision == auto_precision(is_cuda=False) == "fp32"
    old_gpu = DeviceCapacity(worker="w:1", device="cuda:0", total_bytes=1, bf16=False)
    assert auto_precision(is_cuda=old_gpu.is_cuda, bf16_supported=old_gpu.bf16) == "fp16"


def test_checkpoint_due_every_n_steps_and_never_without_a_cadence():
    assert [s for s in range(1, 11) if checkpoint_due(s, 4)] == [4, 8]
    assert not any(checkpoint_due(s, None) for s in range(1, 11))


def test_fit_refusal_names_the_sizes_and_the_field_only_when_they_do_not_fit():
    engine = {"context_length": 128, "max_batch_size": 8, "max_tokens_in_flight": 1000}
    assert fit_refusal(100, SamplingParams(max_new_tokens=28), **engine) is None
    field, message = fit_refusal(120, SamplingParams(max_new_tokens=16), **engine, field="max_completion_tokens")
    assert field == "max_completion_tokens" and "(120 tokens) + max_completion_tokens (16) = 136" in message
    assert "128" in message and "max_new_tokens" not in message
    assert fit_refusal(10, SamplingParams(n=9), **engine).field == "n"
    in_flight = fit_refusal(100, SamplingParams(max_new_tokens=28, n=8), **engine, field="max_tokens")
    assert in_flight.field == "max_tokens" and "max_tokens_in_flight=1000" in in_flight.message


def test_sse_framing_of_both_streams():
    assert sse_message({"a": 1, "b": [2]}) == 'data: {"a": 1, "b": [2]}\n\n'
    assert sse_message("[DONE]") == "data: [DONE]\n\n"
    framed = sse_message({"a": 1}, event="state", id="4-12", separators=COMPACT)
    assert framed == 'id: 4-12\nevent: state\ndata: {"a":1}\n\n'
    fields = dict(line.split(": ", 1) for line in framed.strip().splitlines())
    assert json.loads(fields["data"]) == {"a": 1}
    assert sse_comment("ping") == ": ping\n\n" and sse_retry(2000) == "retry: 2000\n\n"


def test_redis_keys_share_one_prefix_and_never_collide():
    keys = [redis_keys.capacity_key("h:1"), redis_keys.stream_key("r"), redis_keys.cancel_key("r"),
            redis_keys.slots_key("m"), redis_keys.tenant_slots_key("m", "t"), redis_keys.rate_key("k"),
            redis_keys.classify_reply_key("r"), redis_keys.abandoned_key("r"), redis_keys.uploads_key("t"),
            redis_keys.inference_key("t"), redis_keys.BROKER_SENTINEL]
    assert all(key.startswith(redis_keys.PREFIX) for key in keys) and len(set(keys)) == len(keys)
    assert redis_keys.capacity_key("h:1").startswith(redis_keys.CAPACITY_PREFIX)


# --- Generation limits: core.generation_limits ---

TOKEN_FIELDS = {"max_new_tokens", "max_tokens", "max_completion_tokens", "max_completions_tokens"}
# What the scan reads: everything between a request and the engine (the engine's own arguments and training are
# not request limits), less the files where a number is the decision itself.
SCANNED = ("app", "core", "worker/servers", "worker/batches", "trainserve")
WRITTEN_THERE = {"core/generation_limits.py": "the defaults and the bound", "core/settings.py": "the server's cap",
                 "core/reinforcement.py": "GRPO's rollout length, a training hyperparameter"}


def _numbers(node: ast.AST | None) -> list[int]:
    """Integer literals other than 0 and 1 (ge=1 says "positive", not a limit) in a piece of code."""
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and type(n.value) is int
            and n.value > 1] if node is not None else []


def _token_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each token count written as a number: a field's default or bound, a keyword argument,
    an `x.max_tokens or 16` fallback, a CLI option's default, a module constant named like one."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in TOKEN_FIELDS:
            numbers = _numbers(node.annotation) + _numbers(node.value)
        elif isinstance(node, ast.keyword) and node.arg in TOKEN_FIELDS:
            numbers = _numbers(node.value)
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and any(
                isinstance(v, ast.Attribute) and v.attr in TOKEN_FIELDS for v in node.values):
            numbers = _numbers(node)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and "tokens" in str(node.args[0].value):
            numbers = [n for k in node.keywords if k.arg == "default" for n in _numbers(k.value)]
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and "MAX_TOKENS" in t.id
                                                  for t in node.targets):
            numbers = _numbers(node.value)
        else:
            continue
        found += [(node.lineno, ast.unparse(node)[:80]) for _ in numbers[:1]]
    return found


def test_each_generation_default_and_bound_is_written_once():
    """The defaults (16, 256, 64) and the schemas' bound (8192) were written in 13 places; now in one module."""
    written = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            if name not in WRITTEN_THERE:
                written.update({f"{name}:{line}": what for line, what in _token_literals(ast.parse(path.read_text()))})
    assert written == {}


def test_the_schemas_and_the_wire_read_the_defaults_and_the_bound():
    from app.schemas.chat import ChatCompletionRequest
    from app.schemas.generation import CompletionRequest, GenerateRequest
    from core.evals import CompletionsSampling
    from core.graders.spec import JudgeSampling
    from core.settings import Settings

    assert GenerateRequest.model_fields["max_new_tokens"].default == SamplingParams().max_new_tokens == GENERATE.default
    assert CompletionRequest.model_fields["max_tokens"].default == COMPLETIONS.default
    bounded = [(GenerateRequest, "max_new_tokens"), (CompletionRequest, "max_tokens"),
               (ChatCompletionRequest, "max_tokens"), (ChatCompletionRequest, "max_completion_tokens"),
               (CompletionsSampling, "max_completion_tokens"), (JudgeSampling, "max_completions_tokens"),
               (Settings, "max_new_tokens")]
    for schema, name in bounded:
        assert f"le={MAX_TOKENS_BOUND}" in repr(schema.model_fields[name]), (schema, name)
    assert EVAL_RUN.default == CHAT.default


@pytest.mark.parametrize(("sent", "expected"), [
    ({}, (256, "max_completion_tokens")),
    ({"max_tokens": 9}, (9, "max_tokens")),
    ({"max_completion_tokens": 9}, (9, "max_completion_tokens")),
    ({"max_completion_tokens": 9, "max_tokens": 9}, (9, "max_completion_tokens")),
])
def test_a_chat_names_the_token_field_it_sent(sent, expected):
    assert CHAT.chosen(sent) == expected


def test_the_server_limits_name_the_field():
    limits = SimpleNamespace(max_new_tokens=8, max_response_entries=100)
    assert server_refusal(SamplingParams(max_new_tokens=8), "max_tokens", limits) is None
    over = server_refusal(SamplingParams(max_new_tokens=9), "max_completion_tokens", limits)
    assert over.field == "max_completion_tokens" and "at most 8 on this server" in over.message
    big = server_refusal(SamplingParams(max_new_tokens=8, n=4, logprobs=3), "max_tokens", limits)
    assert big.field == "max_tokens" and "= 128 token entries" in big.message


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/generate", {"model": "m", "prompt": "hi", "max_new_tokens": 9}, "max_new_tokens"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 9}, "max_tokens"),
    ("/v1/chat/completions", {"model": "m", "messages": HI, "max_tokens": 9}, "max_tokens"),
    ("/v1/chat/completions", {"model": "m", "messages": HI, "max_completion_tokens": 9}, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": "m", "messages": HI}, "max_completion_tokens"),  # its default, 256
    ("/v1/fine_tuning/alpha/graders/validate", {"grader": {
        "type": "score_model", "name": "j", "model": "m", "input": [{"role": "user", "content": "x"}],
        "sampling_params": {"max_completions_tokens": 9}}}, "grader.sampling_params.max_completions_tokens"),
    ("/v1/fine_tuning/alpha/graders/run", {"model_sample": "x", "grader": {"type": "multi", "name": "m",
        "calculate_output": "j", "graders": {"j": {"type": "label_model", "name": "j", "model": "m",  # its 64
                                                  "input": [{"role": "user", "content": "x"}], "labels": ["a"],
                                                  "passing_labels": ["a"]}}}},
     "grader.graders.j.sampling_params.max_completions_tokens"),
    ("/v1/evals", {"data_source_config": {"type": "custom", "item_schema": {"type": "object"}},
                   "testing_criteria": [{"type": "string_check", "name": "s", "input": "a", "reference": "a",
                                         "operation": "eq"},
                                        {"type": "score_model", "name": "j", "model": "m",
                                         "input": [{"role": "user", "content": "x"}]}]},
     "testing_criteria.1.sampling_params.max_completions_tokens"),
])
def test_a_request_over_the_server_cap_is_a_422_naming_its_own_field(client, settings, path, body, field):
    settings.max_new_tokens = 8
    response = client.post(path, json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field and f"{field} must be at most 8 on this server" in error["message"], error


def test_an_eval_run_over_the_server_cap_names_its_sampling_field(client, settings):
    from tests.tiny_lm import build_tiny_gpt2

    build_tiny_gpt2(settings.home / "models" / "tiny", n_positions=64)
    created = client.post("/v1/evals", json={"data_source_config": {"type": "custom", "item_schema": {
        "type": "object"}}, "testing_criteria": [{"type": "string_check", "name": "s", "input": "a",
                                                  "reference": "a", "operation": "eq"}]})
    assert created.status_code == 200, created.text
    settings.max_new_tokens = 8
    source = {"type": "completions", "model": "tiny", "source": {"type": "file_content", "content": [{"item": {}}]},
              "input_messages": {"type": "template", "template": [{"role": "user", "content": "hi"}]}}
    for sampling in ({"max_completion_tokens": 9}, {}):  # sent, or the default (256)
        response = client.post(f"/v1/evals/{created.json()['id']}/runs",
                               json={"data_source": {**source, "sampling_params": sampling}})
        assert response.status_code == 422, response.text
        assert response.json()["error"]["field"] == EVAL_RUN.name


@pytest.mark.parametrize(("url", "body", "field"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9},
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 9}, "max_tokens"),
])
def test_a_batch_line_over_the_server_cap_names_its_own_field(url, body, field):
    from app.services.batch_plan import Planning, plan_lines
    from core.served_models import ServedModel
    from core.settings import Settings

    planning = Planning(served=lambda name: ServedModel(id=name, path="/m", owned_by="t", created=0),
                        embedding=str, settings=Settings(max_new_tokens=8))
    lines = [{"custom_id": "a", "method": "POST", "url": url, "body": {"model": "tiny", **body}},
             {"custom_id": "b", "method": "POST", "url": url, "body": {"model": "tiny", **body, field: 8}}]
    stream = io.BytesIO(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    over, within = plan_lines(stream, endpoint=url, planning=planning)
    assert over.error is not None and over.error.param == field and over.error.status_code == 422
    assert within.error is None and within.tokens_field == field and within.params.max_new_tokens == 8


def test_the_worker_names_the_field_the_request_sent_when_it_cannot_fit():
    from worker.servers.generation import engine_fit

    engine = SimpleNamespace(context_length=64, max_batch_size=4, max_tokens_in_flight=10_000)
    refusal = engine_fit(engine, 60, SamplingParams(max_new_tokens=8), "max_completion_tokens")
    assert refusal is not None and refusal.field == "max_completion_tokens"
    assert engine_fit(engine, 10, SamplingParams(max_new_tokens=8), "max_tokens") is None


def test_an_eval_runs_and_a_judges_token_counts_come_from_one_place(settings):
    from core.eval_runs import run_sampling
    from core.evals import CompletionsDataSource
    from core.graders.models import ModelCallFailed, judge_tokens
    from core.graders.spec import JudgeSampling

    source = CompletionsDataSource.model_validate({
        "type": "completions", "model": "m", "source": {"type": "file_content", "content": [{"item": {}}]},
        "input_messages": {"type": "template", "template": [{"role": "user", "content": "hi"}]}})
    assert run_sampling(source, settings).max_new_tokens == EVAL_RUN.default
    assert judge_tokens(None, 1024) == JUDGE.default and judge_tokens(JudgeSampling(max_completions_tokens=9), 9) == 9
    with pytest.raises(ModelCallFailed, match="sampling_params.max_completions_tokens must be at most 8"):
        judge_tokens(None, 8)
    settings.max_new_tokens = 8
    with pytest.raises(ValidationFailed) as refused:
        run_sampling(source, settings)
    assert refused.value.field == EVAL_RUN.name


def test_the_generation_worker_builds_its_engine_with_the_settings_tokens_in_flight(settings, monkeypatch):
    from worker.engines.generation import engine as engine_module
    from worker.servers.generation import GenerationService

    seen: dict = {}

    class Built(Exception):
        pass

    def record(model, **kwargs):
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(engine_module, "GenerationEngine", record)
    settings.max_tokens_in_flight = 1234
    with pytest.raises(Built):
        GenerationService(settings, None, None)._load("/models/x")
    assert seen["max_tokens_in_flight"] == 1234
