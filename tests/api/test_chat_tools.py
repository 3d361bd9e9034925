"""Tool calls and reasoning on /v1/chat/completions through the official `openai` client: each family's template
(Qwen 2.5 / Hermes, Llama 3.1 JSON, Mistral [TOOL_CALLS]) and a template with no tool section (the default tool
prompt) on a random tiny model, tool_choice required, named and auto, streamed and not, at temperature 0 and 1,
beside a response_format too; every call parses and its arguments validate. A Qwen 3-style template's thinking comes
back as reasoning_content.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.tiny_tools import build_tool_model

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Sum", "parameters": ADD, "strict": True}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
FAMILIES = ("qwen25", "llama31", "mistral")
# A random model never stops calling when it may call again, so most tests ask for one call.
ONE = {"parallel_tool_calls": False}


@pytest.fixture()
def models(settings, worker_ctx):  # noqa: F811
    for name in (*FAMILIES, "qwen3"):
        build_tool_model(settings.home / "models" / name, name)


@pytest.fixture()
def api(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=client.headers["Authorization"].split()[1],
                         http_client=client, max_retries=0)


def _valid(calls, names=None):
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(api, **kwargs):
    """A streamed answer gathered as OpenAI's clients do: content, reasoning and calls by index."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in api.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": piece.id, "name": "", "arguments": ""})
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_calls_always_validate(api, models, family, temperature):
    reply = api.chat.completions.create(model=family, messages=CHAT, tools=TOOLS, tool_choice="required",
                                        temperature=temperature, max_tokens=120, n=2, seed=3, **ONE)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        _valid(choice.message.tool_calls)
    named = {"type": "function", "function": {"name": "add"}}
    reply = api.chat.completions.create(model=family, messages=CHAT, tools=TOOLS, tool_choice=named,
                                        temperature=temperature, max_tokens=120, seed=4)
    _valid(reply.choices[0].message.tool_calls, ["add"])
    assert len(reply.choices[0].message.tool_calls) == 1
    content, _, calls, finish = _streamed(api, model=family, messages=CHAT, tools=TOOLS, tool_choice="required",
                                          temperature=temperature, max_tokens=120, seed=5, **ONE)
    assert finish == "tool_calls" and not content
    for call in calls:
        assert call["name"] in SCHEMAS
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_calls_equal_the_whole_answer(api, models, family):
    """Greedy: the streamed deltas add up to the non-streamed message, calls and finish reason alike."""
    kwargs = {"model": family, "messages": CHAT, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
              "max_tokens": 120, **ONE}
    whole = api.chat.completions.create(**kwargs).choices[0]
    _, _, calls, finish = _streamed(api, **kwargs)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert finish == whole.finish_reason == "tool_calls"


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_answers_text_or_valid_calls(api, models, family):
    reply = api.chat.completions.create(model=family, messages=CHAT, tools=TOOLS, temperature=1.0, max_tokens=60,
                                        n=4, seed=1, **ONE)
    for choice in reply.choices:
        if choice.message.tool_calls:
            _valid(choice.message.tool_calls)
            assert choice.finish_reason == "tool_calls"
        else:
            assert "<tool_call>" not in (choice.message.content or "")


def test_a_tool_result_turn_renders_and_parallel_calls_are_allowed(api, models):
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = api.chat.completions.create(model="qwen25", messages=history, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=True, temperature=0, max_tokens=120)
    # Greedy, this random model calls on and on: cut short, the complete calls stand (the cut one is dropped).
    assert reply.choices[0].finish_reason == "length"
    assert len(reply.choices[0].message.tool_calls) >= 2
    _valid(reply.choices[0].message.tool_calls)


def test_thinking_comes_back_as_reasoning_content(api, models):
    """The grammar makes the model open its thinking section first; a random model closes it now and then (seeded:
    3 of these 8 choices), and only then may it call."""
    kwargs = {"model": "qwen3", "messages": CHAT, "temperature": 1.0, "max_tokens": 500, "tools": TOOLS,
              "tool_choice": "required", **ONE}
    reply = api.chat.completions.create(n=8, seed=2, **kwargs)
    called = [c for c in reply.choices if c.message.tool_calls]
    assert called
    for choice in reply.choices:  # the others ran out of tokens, thinking or with a call cut short
        assert choice.message.reasoning_content and "<think>" not in choice.message.reasoning_content
        assert not choice.message.content
        assert choice.finish_reason == ("tool_calls" if choice.message.tool_calls else "length")
    for choice in called:
        assert "</think>" not in choice.message.reasoning_content
        _valid(choice.message.tool_calls)
    first = called[0]
    content, reasoning, calls, finish = _streamed(api, seed=2 + first.index, **kwargs)  # choice i draws with seed+i
    assert reasoning == first.message.reasoning_content and not content and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in first.message.tool_calls]


def test_structured_output_applies_after_the_thinking_section(api, models):
    reply = api.chat.completions.create(model="qwen3", messages=CHAT, temperature=1.0, max_tokens=500, n=8, seed=2,
                                        response_format={"type": "json_schema", "json_schema": {
                                            "name": "weather", "schema": WEATHER}})
    finished = [c for c in reply.choices if c.finish_reason == "stop"]
    assert finished
    for choice in finished:
        assert choice.message.reasoning_content
        jsonschema.validate(json.loads(choice.message.content), WEATHER)


def test_enable_thinking_false_leaves_no_reasoning(api, models):
    """The template writes an empty thinking section itself, so the answer is the call alone."""
    reply = api.chat.completions.create(model="qwen3", messages=CHAT, tools=TOOLS, tool_choice="required",
                                        temperature=1.0, max_tokens=120, seed=2, **ONE,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None
    _valid(reply.choices[0].message.tool_calls)


@pytest.mark.parametrize(("body", "field"), [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tool_requests_are_422_naming_the_field(client, models, body, field):
    response = client.post("/v1/chat/completions", json={"model": "qwen25", "messages": CHAT, **body})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field


@pytest.fixture()
def plain(settings, worker_ctx):  # noqa: F811
    """A tiny Llama whose template has no tool section (as most models'): served with the default tool prompt."""
    build_tool_model(settings.home / "models" / "plain-chat", "plain")
    return "plain-chat"


def test_a_template_without_tool_calls_gets_the_default_prompt(api, plain):
    """Named, required, auto, streamed and a round trip with a tool result: the Hermes form, constrained and parsed
    as on a tool-calling template."""
    named = {"type": "function", "function": {"name": "add"}}
    reply = api.chat.completions.create(model=plain, messages=CHAT, tools=TOOLS, tool_choice=named,
                                        temperature=1.0, max_tokens=120, seed=4)
    assert reply.choices[0].finish_reason == "tool_calls"
    _valid(reply.choices[0].message.tool_calls, ["add"])
    kwargs = {"model": plain, "messages": CHAT, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
              "max_tokens": 120, **ONE}
    whole = api.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    _valid(whole.message.tool_calls)
    content, _, calls, finish = _streamed(api, **kwargs)
    assert not content and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    reply = api.chat.completions.create(model=plain, messages=CHAT, tools=TOOLS, temperature=1.0, max_tokens=60,
                                        n=4, seed=1, **ONE)
    for choice in reply.choices:
        if choice.message.tool_calls:
            _valid(choice.message.tool_calls)
        else:
            assert "<tool_call>" not in (choice.message.content or "")
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = api.chat.completions.create(model=plain, messages=history, tools=TOOLS, tool_choice="required",
                                        temperature=0, max_tokens=120, **ONE)
    _valid(reply.choices[0].message.tool_calls)
    reply = api.chat.completions.create(model=plain, messages=history, tools=TOOLS, tool_choice="none",
                                        temperature=0, max_tokens=10)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason != "tool_calls"


@pytest.mark.parametrize("model", ["plain-chat", "qwen25"])
def test_tools_beside_a_response_format_answer_calls_or_the_formats_json(api, models, plain, model):
    """Under auto the answer is either valid calls or the format's JSON; under required, calls."""
    schema = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    reply = api.chat.completions.create(model=model, messages=CHAT, tools=TOOLS, response_format=schema,
                                        temperature=1.0, max_tokens=120, n=6, seed=7, **ONE)
    kinds = set()
    for choice in reply.choices:
        if choice.message.tool_calls:
            kinds.add("calls")
            _valid(choice.message.tool_calls)
            assert choice.finish_reason == "tool_calls"
        else:
            kinds.add("json")
            jsonschema.validate(json.loads(choice.message.content), WEATHER)
            assert choice.finish_reason == "stop"
    assert kinds == {"calls", "json"}, kinds
    reply = api.chat.completions.create(model=model, messages=CHAT, tools=TOOLS, tool_choice="required",
                                        response_format={"type": "json_object"}, temperature=1.0, max_tokens=120,
                                        seed=8, **ONE)
    _valid(reply.choices[0].message.tool_calls)


def test_batch_chat_lines_take_tools_and_answer_as_the_interactive_route(api, models, worker_ctx, queue):  # noqa: F811
    import time

    from core.tasks import TASK_BATCH
    from worker.batches.run import run_batch

    queue.handlers[TASK_BATCH] = lambda batch_id: run_batch(worker_ctx, batch_id)
    body = {"model": "qwen25", "messages": CHAT, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
            "max_tokens": 120, **ONE}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    upload = api.files.create(file=("tools.jsonl", json.dumps(line).encode() + b"\n"), purpose="batch")
    batch = api.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while (batch := api.batches.retrieve(batch.id)).status not in ("completed", "failed") \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert batch.status == "completed" and batch.request_counts.completed == 1, batch
    answer = json.loads(api.files.content(batch.output_file_id).read())["response"]["body"]["choices"][0]
    interactive = api.chat.completions.create(**body).choices[0]
    assert answer["finish_reason"] == interactive.finish_reason == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in answer["message"]["tool_calls"]] == [
        (c.function.name, c.function.arguments) for c in interactive.message.tool_calls]


def test_a_schema_the_grammar_cannot_enforce_is_a_422_naming_its_field(client, models):
    unenforceable = {"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": unenforceable}}]
    answer = client.post("/v1/chat/completions", json={"model": "qwen25", "messages": CHAT, "tools": tools})
    assert answer.status_code == 422 and answer.json()["error"]["field"] == "tools", answer.text
    answer = client.post("/v1/chat/completions", json={  # after a thinking section, the grammar names its field
        "model": "qwen3", "messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": unenforceable}}})
    assert answer.status_code == 422 and answer.json()["error"]["field"] == "response_format", answer.text
