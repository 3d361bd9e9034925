"""The Responses API's translation to the chat path and back (app/services/response_items.py) and its streamed
events (app/services/response_stream.py): plain functions, no server."""

from __future__ import annotations

import pytest

from app.schemas.responses import ResponseCreate
from app.services.response_items import (
    chat_messages,
    chat_request,
    input_items,
    output_items,
    response_usage,
    responses_field,
)
from app.services.response_stream import ResponseStream
from core.errors import ValidationFailed
from core.protocol import ChoiceOut, Usage

TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_text_input_is_one_user_message_with_an_id():
    [item] = input_items("Hi")
    assert item["type"] == "message" and item["role"] == "user" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "input_text", "text": "Hi"}]


def test_items_become_chat_messages_calls_joining_the_assistant_turn():
    items = input_items([
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking.",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "rain"}]},
    ])
    assert [i["id"][:3] for i in items] == ["msg", "msg", "rs_", "msg", "fc_", "fc_", "fco", "fco"]
    messages = chat_messages("System.", items)
    assert messages == [
        {"role": "system", "content": "System."},
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": "Weather ?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": f"call_{c}", "type": "function",
             "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
            for c, city in (("a", "Paris"), ("b", "Rome"))]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "rain"}]


def test_a_call_with_no_assistant_text_opens_its_own_turn():
    items = input_items([{"role": "user", "content": "Hi"},
                         {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}])
    assert chat_messages(None, items)[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_the_chat_request_carries_tools_choice_format_and_sampling():
    body = ResponseCreate(model="m", input="Hi", instructions="Sys", tools=[TOOL],
                          tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
                          max_output_tokens=50, temperature=0.5, top_p=0.9, top_k=5)
    chat = chat_request(body, input_items("Hi"))
    assert chat.tools == [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.top_k) == (50, 0.5, 0.9, 5)
    assert chat.parallel_tool_calls is False and chat.messages[0].role == "system"
    schema = {"type": "object"}
    formatted = chat_request(ResponseCreate(model="m", input="Hi", tools=[], text={"format": {
        "type": "json_schema", "name": "x", "schema": schema, "strict": True}}), input_items("Hi"))
    assert formatted.response_format == {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                                "strict": True}}
    assert formatted.tools is None  # [] as OpenAI takes it: no tools
    assert chat_request(ResponseCreate(model="m", input="Hi", text={"format": {"type": "text"}}),
                        input_items("Hi")).response_format is None


@pytest.mark.parametrize(("body", "field"), [
    ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input.0.name"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0.arguments"),
    ({"input": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]}, "input.0.content.0.type"),
    ({"tools": [{**TOOL, "defer_loading": True}]}, "tools.0.defer_loading"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"text": {"format": {"type": "json_object", "schema": {}}}}, "text.format.schema"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"stream_options": {"include_usage": True}}, "stream_options.include_usage"),
])
def test_refusals_name_the_responses_field(body, field):
    request = ResponseCreate(model="m", **{"input": "Hi", **body})
    with pytest.raises(ValidationFailed) as refused:
        chat_request(request, input_items(request.input))
    assert refused.value.field == field


@pytest.mark.parametrize(("chat", "responses"), [
    ("response_format", "text.format"), ("response_format.json_schema.schema", "text.format.schema"),
    ("tools.2.function", "tools.2"), ("tools.0.function.parameters", "tools.0.parameters"), ("tools", "tools"),
    ("max_completion_tokens", "max_output_tokens"), ("messages.3.content", "input"), ("tool_choice", "tool_choice"),
    (None, None)])
def test_chat_fields_are_named_as_the_responses_request_sent_them(chat, responses):
    assert responses_field(chat) == responses


def test_a_choice_becomes_reasoning_message_and_calls():
    call = {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    items = output_items(ChoiceOut(index=0, text="", finish_reason="tool_calls", reasoning="think",
                                   tool_calls=[call]))
    assert [i["type"] for i in items] == ["reasoning", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert (items[1]["call_id"], items[1]["name"], items[1]["arguments"]) == ("call_x", "f", "{}")
    [message] = output_items(ChoiceOut(index=0, text="Hi", finish_reason="length"))
    assert message["status"] == "incomplete" and message["content"][0]["text"] == "Hi"
    usage = response_usage(Usage(prompt_tokens=7, completion_tokens=5, cached_tokens=3, reasoning_tokens=2))
    assert usage == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 3}, "output_tokens": 5,
                     "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 12}


def test_streamed_deltas_open_and_close_items_in_order():
    stream = ResponseStream()
    events = [*stream.feed("", "thi", None), *stream.feed("", "nk", None),
              *stream.feed("", None, [{"index": 0, "id": "call_1", "type": "function",
                                       "function": {"name": "f", "arguments": '{"a"'}}]),
              *stream.feed("", None, [{"index": 0, "function": {"arguments": ": 1}"}}]),
              *stream.feed("", None, [{"index": 1, "id": "call_2", "type": "function",
                                       "function": {"name": "g", "arguments": "{}"}}]),
              *stream.finish("completed")]
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [(i["type"], i.get("arguments")) for i in stream.items] == [
        ("reasoning", None), ("function_call", '{"a": 1}'), ("function_call", "{}")]
    assert stream.items[0]["content"][0]["text"] == "think" and [e["output_index"] for e in events][-1] == 2


def test_an_empty_answer_streams_an_empty_message():
    stream = ResponseStream()
    types = [e["type"] for e in stream.finish("incomplete")]
    assert types == ["response.output_item.added", "response.content_part.added", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done"]
    assert stream.items[0]["status"] == "incomplete" and stream.items[0]["content"][0]["text"] == ""


def test_metadata_is_held_to_openais_bounds():
    from pydantic import ValidationError

    ResponseCreate(model="m", input="Hi", metadata={f"k{i}": "v" * 512 for i in range(16)})
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}):
        with pytest.raises(ValidationError):
            ResponseCreate(model="m", input="Hi", metadata=metadata)
