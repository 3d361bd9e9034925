"""The default tool prompt for a template that renders no tools: the tools in the system message, earlier calls and
tool results as plain text the template renders as any other turn; and the grammar over it, walked token by token
with llguidance on a tokenizer that holds `<tool_call>` as plain text (as SmolLM2's): calls of the tools only, their
open values bounded, and beside a response_format either calls or the format's JSON."""

from __future__ import annotations

import json

import pytest

from core.protocol import Constraint, ValueBounds
from core.tool_calls import HERMES, ChoiceParser, check_tools, family_of, template_messages
from core.tool_grammar import lark, tool_rules
from core.tool_prompt import plain_messages, tools_prompt
from tests.tiny_chat import CHATML_TEMPLATE, build_chat_tokenizer
from tests.tiny_tools import grammar_accepts

TOOLS = check_tools([
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}])
HISTORY = [
    {"role": "user", "content": "Weather in Rome and Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]
CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_the_tools_go_in_a_system_message_and_calls_and_results_are_text():
    plain = plain_messages(template_messages(HISTORY), TOOLS)
    assert [m["role"] for m in plain] == ["system", "user", "assistant", "user"]
    assert plain[0]["content"] == tools_prompt(TOOLS)
    assert plain[0]["content"].startswith("# Tools\n") and "<tool_call>\n{\"name\": <function-name>" in plain[0][
        "content"]
    for tool in TOOLS:  # one JSON object a line, with tojson's separators
        assert "\n" + json.dumps(tool) + "\n" in plain[0]["content"]
    assert plain[2] == {"role": "assistant", "content": CALLS}
    assert plain[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>\n"
                                                   "<tool_response>\nrain\n</tool_response>"}


def test_the_clients_system_message_comes_first_and_none_lists_no_tools():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Let me see.", "tool_calls": HISTORY[1]["tool_calls"][:1]}]
    plain = plain_messages(template_messages(chat), TOOLS)
    assert plain[0] == {"role": "system", "content": "Be brief.\n\n" + tools_prompt(TOOLS)}
    assert plain[2]["content"] == "Let me see.\n" + CALLS.split("\n<tool_call>")[0]
    assert plain_messages(template_messages(chat), None)[0] == {"role": "system", "content": "Be brief."}
    folded = plain_messages(template_messages(chat), TOOLS, system_role=False)  # a template without a system role
    assert [m["role"] for m in folded] == ["user", "assistant"]
    assert folded[0]["content"] == "Be brief.\n\n" + tools_prompt(TOOLS) + "\n\nHi"


def test_a_plain_template_renders_the_prompt_as_ordinary_turns():
    tokenizer = build_chat_tokenizer(CHATML_TEMPLATE)
    assert family_of(CHATML_TEMPLATE) is None
    text = tokenizer.apply_chat_template(plain_messages(template_messages(HISTORY), TOOLS), tokenize=False,
                                         add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert f"<|im_start|>assistant\n{CALLS}<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = build_chat_tokenizer(CHATML_TEMPLATE)  # no added <tool_call>: the marker is plain text
    assert "<tool_call>" not in tokenizer.get_added_vocab()
    return tokenizer


def _call(name: str, arguments: str) -> str:
    return HERMES.prefix + HERMES.call_text(name, arguments) + HERMES.suffix


def test_the_grammar_reads_a_plain_text_marker(tokenizer):
    auto = lark(tool_rules(HERMES, TOOLS, "auto", True, {}), think=None, token_ids={})
    assert grammar_accepts(tokenizer, auto, _call("add", '{"a": 1}') + "\n" + _call("get_weather", '{"city": "Rome"}'))
    assert grammar_accepts(tokenizer, auto, "Hello there.")
    assert not grammar_accepts(tokenizer, auto, "Sure <tool_call>")
    assert not grammar_accepts(tokenizer, auto, _call("remove", '{"a": 1}'))
    required = lark(tool_rules(HERMES, TOOLS, "required", False, {}), think=None, token_ids={})
    assert grammar_accepts(tokenizer, required, _call("add", '{"a": 1}'))
    assert not grammar_accepts(tokenizer, required, "Hello there.")
    named = lark(tool_rules(HERMES, TOOLS, "get_weather", True, {}), think=None, token_ids={})
    assert grammar_accepts(tokenizer, named, _call("get_weather", '{"city": "Rome"}'))
    assert not grammar_accepts(tokenizer, named, _call("add", '{"a": 1}'))


def test_the_calls_open_values_are_bounded_as_structured_output(tokenizer):
    bounds = ValueBounds(max_string_chars=5, max_number_digits=3, max_fraction_digits=2)
    grammar = lark(tool_rules(HERMES, TOOLS, "required", False, {}, bounds=bounds), think=None, token_ids={})
    assert grammar_accepts(tokenizer, grammar, _call("add", '{"a": 999}'))
    assert not grammar_accepts(tokenizer, grammar, _call("add", '{"a": 1000}'))
    assert grammar_accepts(tokenizer, grammar, _call("get_weather", '{"city": "Rome"}'))
    assert not grammar_accepts(tokenizer, grammar, _call("get_weather", '{"city": "Rome!!"}'))
    unbounded = lark(tool_rules(HERMES, TOOLS, "required", False, {}), think=None, token_ids={})
    assert grammar_accepts(tokenizer, unbounded, _call("add", '{"a": 123456789}'))


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_beside_a_response_format_the_answer_is_calls_or_the_formats_json(tokenizer, kind):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    answer = Constraint(kind=kind, spec=json.dumps(schema) if kind == "json_schema" else "")
    auto = lark(tool_rules(HERMES, TOOLS, "auto", True, {}, answer=answer), think=None, token_ids={})
    assert grammar_accepts(tokenizer, auto, '{"answer": 4}')
    assert grammar_accepts(tokenizer, auto, _call("add", '{"a": 1}'))
    assert not grammar_accepts(tokenizer, auto, "Hello there.")
    assert grammar_accepts(tokenizer, auto, '{"other": 4}') == (kind == "json_object")
    required = lark(tool_rules(HERMES, TOOLS, "required", True, {}, answer=answer), think=None, token_ids={})
    assert not grammar_accepts(tokenizer, required, '{"answer": 4}')
    parser = ChoiceParser(HERMES, reasoning=False)  # the JSON answer comes back as content
    parser.feed('{"answer"')
    parser.feed(": 4}")
    assert parser.result().content == '{"answer": 4}' and not parser.result().calls
