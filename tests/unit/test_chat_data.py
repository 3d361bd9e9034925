"""Chat, preference and completion JSON Lines: detection, per-line checks with the line named, streaming limits."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from core.chat_data import detect_format, open_rows, read_records, summarize_upload
from core.errors import PayloadTooLarge, ValidationFailed

CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello!", "weight": 0}, {"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": "4"}]}
PREFERENCE = {"input": {"messages": [{"role": "user", "content": "Name a colour"}]},
              "preferred_output": [{"role": "assistant", "content": "Blue"}],
              "non_preferred_output": [{"role": "assistant", "content": "Seven"}]}
COMPLETION = {"prompt": "Q: 2+2?\nA:", "completion": " 4"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
TOOL_CHAT = {"tools": [WEATHER], "parallel_tool_calls": False, "messages": [
    {"role": "user", "content": "Weather in Rome?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}
TOOL_PREFERENCE = {"input": {"messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": [WEATHER]},
                   "preferred_output": [{"role": "assistant", "tool_calls": [CALL]}],
                   "non_preferred_output": [{"role": "assistant", "content": "No idea."}]}
PROMPTS = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
           "answer": "4", "accepted": ["4", "four"]}


def _write(tmp_path: Path, records: list, name: str = "d.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


@pytest.mark.parametrize(("record", "fmt", "columns"), [
    (CHAT, "chat", ["messages"]),
    (PREFERENCE, "preference", ["input", "preferred_output", "non_preferred_output"]),
    (COMPLETION, "completion", ["prompt", "completion"]),
    (TOOL_CHAT, "chat", ["messages"]),
    (TOOL_PREFERENCE, "preference", ["input", "preferred_output", "non_preferred_output"]),
    (PROMPTS, "prompts", ["messages"]),
])
def test_each_format_is_detected_and_summarized(tmp_path, record, fmt, columns):
    path = _write(tmp_path, ["", record, record])
    assert detect_format(path, "jsonl") == fmt
    summary = summarize_upload(path, "jsonl")
    assert (summary.format, summary.columns, summary.rows) == (fmt, columns, 2)
    found, records = read_records(path)
    assert found == fmt and [line for line, _ in records] == [2, 3] and records[0][1] == record


def test_tables_stay_tables(tmp_path):
    path = _write(tmp_path, [{"text": "good", "label": 1}])
    assert detect_format(path, "jsonl") == "jsonl"
    assert summarize_upload(path, "jsonl").columns == ["text", "label"]
    tsv = tmp_path / "d.tsv"
    tsv.write_text("text\tlabel\nhi\t1\n")
    assert detect_format(tsv, "tsv") == "tsv"


def _bad_chat(messages: list, **extra) -> dict:
    return {"messages": messages, **extra}


USER = {"role": "user", "content": "Hi"}
REPLY = {"role": "assistant", "content": "Hello"}


@pytest.mark.parametrize(("record", "expected"), [
    (_bad_chat([USER]), "no assistant message"),
    (_bad_chat([USER, dict(REPLY, weight=0)]), "no assistant message"),
    (_bad_chat([]), "messages must be a non-empty list"),
    (_bad_chat([{"role": "robot", "content": "x"}, REPLY]), "messages[0].role must be one of"),
    (_bad_chat([{"role": "user", "content": 3}, REPLY]), "messages[0].content must be a string"),
    (_bad_chat([{"role": "user"}, REPLY]), "messages[0].content must be a string"),
    (_bad_chat([USER, {"role": "assistant", "content": " "}]), "messages[1].content is empty"),
    (_bad_chat([dict(USER, weight=1), REPLY]), "messages[0].weight is allowed on assistant messages only"),
    (_bad_chat([USER, dict(REPLY, weight=2)]), "messages[1].weight must be 0 or 1"),
    (_bad_chat([USER, dict(REPLY, weight=True)]), "messages[1].weight must be 0 or 1"),
    (_bad_chat([USER, dict(REPLY, tool_calls=[CALL])]), "messages[1] has tool_calls but the example has no tools"),
    (_bad_chat([USER, REPLY], tools=[]), "tools: tools must be a non-empty list"),
    (_bad_chat([USER, REPLY], tools=[{"type": "function", "function": {"name": "a b"}}]), "tools.0.function:"),
    (_bad_chat([USER, dict(REPLY, tool_calls=[dict(CALL, function={"name": "other", "arguments": "{}"})])],
               tools=[WEATHER]), "messages[1].tool_calls[0] calls 'other', which is not one of the example's tools"),
    (_bad_chat([USER, dict(REPLY, tool_calls=[dict(CALL, function={"name": "get_weather", "arguments": "[1]"})])],
               tools=[WEATHER]), "messages[1].tool_calls[0].function.arguments: function.arguments must be a JSON"),
    (_bad_chat([USER, dict(REPLY, tool_calls=[CALL, dict(CALL, id="call_2")])], tools=[WEATHER],
               parallel_tool_calls=False), "messages[1] makes 2 calls but parallel_tool_calls is false"),
    (_bad_chat([USER, {"role": "tool", "tool_call_id": "call_9", "content": "x"}, REPLY], tools=[WEATHER]),
     "messages[1].tool_call_id must name a call made earlier"),
    (_bad_chat([USER, dict(REPLY, tool_call_id="call_1")]), "messages[1].tool_call_id is allowed on tool messages"),
    (_bad_chat([USER, REPLY], tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls must be true or"),
    (dict(TOOL_PREFERENCE, input={"messages": [USER], "tools": "x"}), "input.tools: tools must be a non-empty"),
    (_bad_chat(["hi", REPLY]), "messages[0] must be an object"),
    ({"input": {"messages": [USER]}, "preferred_output": [REPLY]}, "field 'non_preferred_output' is missing"),
    (dict(PREFERENCE, preferred_output=[REPLY, REPLY]), "preferred_output must hold exactly one assistant"),
    (dict(PREFERENCE, non_preferred_output=[USER]), "non_preferred_output must hold exactly one assistant"),
    (dict(PREFERENCE, input={"messages": []}), "input.messages must be a non-empty list"),
    (dict(PREFERENCE, input=[USER]), "input must be an object with messages"),
    (dict(COMPLETION, completion=""), "completion must be a non-empty string"),
    (dict(COMPLETION, prompt=None), "prompt must be a string"),
    (dict(COMPLETION, extra="x"), "unknown field 'extra'"),
])
def test_defects_name_the_line_and_the_field(tmp_path, record, expected):
    first = {"messages": [USER, REPLY]} if "messages" in record else (
        PREFERENCE if "input" in record or "preferred_output" in record else COMPLETION)
    path = _write(tmp_path, [first, "", record])
    with pytest.raises(ValidationFailed) as caught:
        summarize_upload(path, "jsonl")
    assert caught.value.field == "file"
    assert caught.value.message.startswith("line 3: ") and expected in caught.value.message, caught.value.message


@pytest.mark.parametrize(("record", "expected"), [
    ({"messages": [{"role": "user", "content": "Hi", "weight": 1}]}, "weight is allowed on assistant messages only"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
     "ends with an assistant turn"),
    ({"answer": "4"}, "messages must be a non-empty list"),
])
def test_a_prompts_line_is_checked(tmp_path, record, expected):
    path = _write(tmp_path, [PROMPTS, record])
    with pytest.raises(ValidationFailed) as caught:
        summarize_upload(path, "jsonl")
    assert caught.value.message.startswith("line 2: ") and expected in caught.value.message, caught.value.message


def test_a_later_line_in_another_format_is_refused(tmp_path):
    path = _write(tmp_path, [CHAT, COMPLETION])
    with pytest.raises(ValidationFailed, match=r"line 2: field 'messages' is missing"):
        summarize_upload(path, "jsonl")


def test_broken_json_and_row_limits(tmp_path):
    with pytest.raises(ValidationFailed, match="line 2: invalid JSON"):
        summarize_upload(_write(tmp_path, [CHAT, "{nope"]), "jsonl")
    with pytest.raises(PayloadTooLarge):
        summarize_upload(_write(tmp_path, [CHAT] * 3), "jsonl", max_rows=2)


def test_preview_reader_yields_the_records(tmp_path):
    data = "\n".join(json.dumps(r) for r in [CHAT, CHAT]).encode()
    reader = open_rows(io.BytesIO(data), "chat")
    assert list(reader) == [CHAT, CHAT] and reader.columns == ["messages"]
