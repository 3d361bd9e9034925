"""/v1/responses through the official `openai` client, on the real gateway and the worker's serving code in-process:
whole and streamed answers (the typed events in OpenAI's order), retrieve, delete, input items, previous_response_id
chains, tenant isolation, a function call round trip on a Qwen 2.5 tool template, reasoning from a Qwen 3 template,
text.format json_schema, and 422s naming the Responses field.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.conftest import make_key
from tests.tiny_tools import build_tool_model

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER, "strict": True}


@pytest.fixture()
def models(settings, worker_ctx):  # noqa: F811
    for name in ("qwen25", "qwen3"):
        build_tool_model(settings.home / "models" / name, name)


def _api(client, key=None):
    key = key or client.headers["Authorization"].split()[1]
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=0)


@pytest.fixture()
def api(client):
    return _api(client)


def test_a_whole_response_then_retrieve_input_items_and_delete(api, models):
    response = api.responses.create(model="qwen25", instructions="Be brief.", input="Hello there",
                                    max_output_tokens=8, temperature=0, metadata={"ticket": "7"})
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "qwen25"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.output_text == message.content[0].text and response.output_text
    usage = response.usage
    assert usage.output_tokens == 8 and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert response.metadata == {"ticket": "7"} and response.instructions == "Be brief." and response.store

    again = api.responses.retrieve(response.id)
    assert again.model_dump() == response.model_dump()
    items = api.responses.input_items.list(response.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Hello there")]

    assert api.responses.delete(response.id) is None  # the client returns nothing for a 200 delete
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(response.id)


def test_the_same_greedy_answer_as_chat_completions(api, client, models):
    """Through an alias, as every generation route resolves model names."""
    assert client.post("/aliases", json={"name": "bot:prod", "target": "qwen25"}).status_code == 201
    chat = api.chat.completions.create(model="qwen25", messages=[{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": "Hi"}],
                                       max_completion_tokens=12, temperature=0)
    response = api.responses.create(model="bot:prod", instructions="Be brief.",
                                    input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                                    max_output_tokens=12, temperature=0, store=False)
    assert response.model == "bot:prod" and response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    with pytest.raises(openai.NotFoundError):  # store false: nothing kept
        api.responses.retrieve(response.id)


def test_streamed_events_come_in_order_and_add_up_to_the_stored_response(api, models):
    kwargs = {"model": "qwen25", "input": "Tell me a story", "max_output_tokens": 10, "temperature": 0}
    whole = api.responses.create(store=False, **kwargs)
    events = list(api.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.output[0].id == events[2].item.id
    assert final.usage.output_tokens == 10
    assert api.responses.retrieve(final.id).output_text == text


def test_previous_response_id_chains_input_and_output(api, models):
    first = api.responses.create(model="qwen25", input="My name is Ada.", max_output_tokens=6, temperature=0)
    second = api.responses.create(model="qwen25", input="What is my name?", previous_response_id=first.id,
                                  max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id
    # The chain is the conversation so far: the same answer as sending it all at once.
    history = [{"role": "user", "content": "My name is Ada."},
               {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": first.output_text}]},
               {"role": "user", "content": "What is my name?"}]
    flat = api.responses.create(model="qwen25", input=history, max_output_tokens=6, temperature=0, store=False)
    assert second.output_text == flat.output_text
    assert second.usage.input_tokens == flat.usage.input_tokens > first.usage.input_tokens
    third = api.responses.create(model="qwen25", input="And again?", previous_response_id=second.id,
                                 max_output_tokens=6, temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    assert [i.content[0].text for i in api.responses.input_items.list(second.id).data] == ["What is my name?"]


def test_responses_are_each_tenants_own(api, client, models, settings):
    mine = api.responses.create(model="qwen25", input="Hi", max_output_tokens=2, temperature=0)
    other = _api(client, make_key(settings.resolved_database_url, tenant="tenant-b"))
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError) as refused:
        other.responses.create(model="qwen25", input="Hi", previous_response_id=mine.id, max_output_tokens=2)
    assert refused.value.body["field"] == "previous_response_id"
    assert api.responses.retrieve(mine.id).id == mine.id


def test_an_expired_response_is_gone(client, models, settings):
    settings.responses_retention_s = 0.001
    api = _api(client)
    gone = api.responses.create(model="qwen25", input="Hi", max_output_tokens=2, temperature=0)
    with pytest.raises(openai.NotFoundError) as refused:
        api.responses.create(model="qwen25", input="Hi", previous_response_id=gone.id, max_output_tokens=2)
    assert refused.value.body["field"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(gone.id)


def test_input_items_page_like_openai_lists(api, models):
    turns = [{"role": "user", "content": f"turn {i}"} for i in range(5)]
    response = api.responses.create(model="qwen25", input=turns, max_output_tokens=1, temperature=0)
    newest = api.responses.input_items.list(response.id, limit=2)
    assert [i.content[0].text for i in newest.data] == ["turn 4", "turn 3"] and newest.has_more
    every = [i.content[0].text for i in api.responses.input_items.list(response.id, limit=2, order="asc")]
    assert every == [f"turn {i}" for i in range(5)]  # the client follows `after` page by page


def test_a_function_call_round_trip(api, models):
    first = api.responses.create(model="qwen25", input="What is the weather in Paris?", tools=[TOOL],
                                 tool_choice="required", parallel_tool_calls=False, temperature=0,
                                 max_output_tokens=120)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert first.status == "completed" and first.tools[0].name == "get_weather"
    # The tool's answer, sent as a function_call_output after the earlier response.
    second = api.responses.create(model="qwen25", previous_response_id=first.id, tools=[TOOL], tool_choice="none",
                                  input=[{"type": "function_call_output", "call_id": call.call_id,
                                          "output": "sunny"}], temperature=0, max_output_tokens=8)
    assert second.output[0].type == "message"
    # The same turn sent whole: the earlier call as an input item.
    whole = api.responses.create(model="qwen25", tools=[TOOL], tool_choice="none", temperature=0,
                                 max_output_tokens=8, store=False,
                                 input=[{"role": "user", "content": "What is the weather in Paris?"},
                                        {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                         "arguments": call.arguments},
                                        {"type": "function_call_output", "call_id": call.call_id,
                                         "output": "sunny"}])
    assert whole.output_text == second.output_text
    assert whole.usage.input_tokens == second.usage.input_tokens


def test_streamed_function_call_events(api, models):
    kwargs = {"model": "qwen25", "input": "Weather in Rome?", "tools": [TOOL], "tool_choice": "required",
              "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 120}
    whole = api.responses.create(store=False, **kwargs)
    events = list(api.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2].item.type == "function_call" and events[2].item.name == "get_weather"
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == events[-3].arguments == whole.output[0].arguments
    assert events[-1].response.output[0].arguments == arguments


def test_reasoning_comes_back_as_a_reasoning_item(api, models):
    """Qwen 3's thinking section is a reasoning item before the call; its tokens are counted apart."""
    kwargs = {"model": "qwen3", "input": "Weather in Paris?", "tools": [TOOL], "tool_choice": "required",
              "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 60}
    response = api.responses.create(store=False, **kwargs)
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.content[0].text
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= response.usage.output_tokens
    events = list(api.responses.create(stream=True, **kwargs))
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == reasoning.content[0].text
    assert [e.type for e in events][2:4] == ["response.output_item.added", "response.content_part.added"]


def test_json_schema_text_format(api, models):
    response = api.responses.create(model="qwen25", input="Weather?", temperature=1.0, max_output_tokens=200,
                                    text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER,
                                                     "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), WEATHER)
    parsed = api.responses.create(model="qwen25", input="Weather?", max_output_tokens=200,
                                  text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(parsed.output_text), dict)


BAD = [
    ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": []}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"max_output_tokens": 10**9}, "max_output_tokens"),
    ({"previous_response_id": "resp_0123456789abcdef01234567"}, "previous_response_id"),
]


def test_bad_requests_name_the_responses_field(client, models):
    for body, field in BAD:
        answer = client.post("/v1/responses", json={"model": "qwen25", "input": "Hi", **body})
        assert answer.status_code == (404 if field == "previous_response_id" else 422), answer.text
        assert answer.json()["error"]["field"] == field, answer.text


def test_cancel_answers_that_only_background_responses_cancel(client, api, models):
    response = api.responses.create(model="qwen25", input="Hi", max_output_tokens=1)
    answer = client.post(f"/v1/responses/{response.id}/cancel")
    assert answer.status_code == 409 and "background" in answer.json()["error"]["message"]
    assert client.post("/v1/responses/resp_0123456789abcdef01234567/cancel").status_code == 404
