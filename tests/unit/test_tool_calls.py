"""Tool calls in each family's format: the family read from a template, the grammar walked token by token with
llguidance (calls of the tools only, free text without the marker, thinking first), and the streaming parser
whose deltas add up to the whole answer however the text is split."""

from __future__ import annotations

import json

import pytest

from core.tool_calls import (
    FAMILIES,
    HERMES,
    LLAMA3,
    MISTRAL,
    ChoiceParser,
    ToolSpecError,
    check_tool_choice,
    check_tools,
    family_of,
)
from core.tool_grammar import lark, tool_rules
from tests.tiny_chat import CHATML_TEMPLATE, build_chat_tokenizer
from tests.tiny_tools import TEMPLATES, grammar_accepts

TOOLS = check_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}])
WEATHER = '{"name": "get_weather", "ARGS": {"city": "Paris"}}'
ADD = '{"name": "add", "ARGS": {"a": 1}}'


def _calls(family, *objects):
    objects = [o.replace("ARGS", family.args_key) for o in objects]
    return family.open + family.between.join(family.prefix + o + family.suffix for o in objects) + family.close


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = build_chat_tokenizer(CHATML_TEMPLATE)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    return tokenizer


def test_the_family_is_read_from_the_template():
    assert family_of(TEMPLATES["qwen25"]) is HERMES and family_of(TEMPLATES["qwen3"]) is HERMES
    assert family_of(TEMPLATES["llama31"]) is LLAMA3 and family_of(TEMPLATES["mistral"]) is MISTRAL
    assert family_of(CHATML_TEMPLATE) is None and family_of(None) is None


@pytest.mark.parametrize("family", FAMILIES.values(), ids=list(FAMILIES))
def test_the_grammar_allows_calls_of_the_tools_only(tokenizer, family):
    ids = {m: tokenizer.convert_tokens_to_ids(m) for m in ("<tool_call>", "</tool_call>", "[TOOL_CALLS]")}
    auto = lark(tool_rules(family, TOOLS, "auto", True, ids), think=None, token_ids=ids)
    assert grammar_accepts(tokenizer, auto, _calls(family, WEATHER, ADD))
    assert grammar_accepts(tokenizer, auto, "Just text.")
    assert not grammar_accepts(tokenizer, auto, _calls(family, WEATHER.replace("Paris", "Oslo")))  # the schema's enum
    assert not grammar_accepts(tokenizer, auto, _calls(family, WEATHER.replace("get_weather", "delete_all")))
    assert not grammar_accepts(tokenizer, auto, _calls(family, WEATHER.replace(": ", ":")))  # tojson's separators
    one = lark(tool_rules(family, TOOLS, "required", False, ids), think=None, token_ids=ids)
    assert grammar_accepts(tokenizer, one, _calls(family, ADD))
    assert not grammar_accepts(tokenizer, one, _calls(family, ADD, ADD))
    assert not grammar_accepts(tokenizer, one, "Just text.")
    named = lark(tool_rules(family, TOOLS, "add", True, ids), think=None, token_ids=ids)
    assert grammar_accepts(tokenizer, named, _calls(family, ADD))
    assert not grammar_accepts(tokenizer, named, _calls(family, WEATHER))
    if family is not LLAMA3:  # free text never writes the marker
        assert not grammar_accepts(tokenizer, auto, f"Sure: {family.marker}")


def test_thinking_comes_first_then_the_calls(tokenizer):
    ids = {m: tokenizer.convert_tokens_to_ids(m) for m in ("<tool_call>", "</tool_call>", "<think>", "</think>")}
    grammar = lark(tool_rules(HERMES, TOOLS, "required", True, ids), think="open", token_ids=ids)
    assert grammar_accepts(tokenizer, grammar, "<think>\nhmm\n</think>\n\n" + _calls(HERMES, ADD))
    assert not grammar_accepts(tokenizer, grammar, _calls(HERMES, ADD))
    inside = lark(tool_rules(HERMES, TOOLS, "required", True, ids), think="inside", token_ids=ids)
    assert grammar_accepts(tokenizer, inside, "hmm\n</think>\n\n" + _calls(HERMES, ADD))


@pytest.mark.parametrize("family", FAMILIES.values(), ids=list(FAMILIES))
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_add_up_to_the_whole_answer(family, step):
    text = _calls(family, WEATHER, ADD)
    parser = ChoiceParser(family, reasoning=False)
    content, calls = "", {}
    for at in range(0, len(text), step):
        piece, _, deltas = parser.feed(text[at:at + step])
        content += piece
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"id": delta.get("id"), "name": "", "arguments": ""})
            call["name"] += delta["function"].get("name", "")
            call["arguments"] += delta["function"]["arguments"]
    piece, _, deltas = parser.finish()
    assert not content and not piece and not deltas
    whole = parser.result()
    assert [(c.id, c.name, c.arguments) for c in whole.calls] == [
        (c["id"], c["name"], c["arguments"]) for c in calls.values()]
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("get_weather", {"city": "Paris"}),
                                                                        ("add", {"a": 1})]


def test_reasoning_and_text_are_split_and_a_cut_call_is_dropped():
    parser = ChoiceParser(HERMES, reasoning=True)
    for piece in ("<thi", "nk>\nweigh", "ing it</th", "ink>\n\nHello", " there"):
        parser.feed(piece)
    assert (parser.result().reasoning, parser.result().content) == ("weighing it", "Hello there")
    streamed = ChoiceParser(None, reasoning=True)  # Qwen 3's newlines around the thought are not reasoning
    deltas = [streamed.feed(piece) for piece in ("<think>\n", "a\n", "b\n", "</think>\n\n", "Hi")]
    deltas.append(streamed.finish())
    assert "".join(d[1] for d in deltas) == streamed.result().reasoning == "a\nb"
    assert "".join(d[0] for d in deltas) == streamed.result().content == "Hi"
    cut = ChoiceParser(HERMES, reasoning=False)
    cut.feed(_calls(HERMES, ADD) + "\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\"")
    assert [c.name for c in cut.result().calls] == ["add"] and cut.result().content == ""
    mistral = ChoiceParser(MISTRAL, reasoning=False)  # [TOOL_CALLS] is a special token that decoding drops
    mistral.feed(" " + _calls(MISTRAL, ADD).removeprefix("[TOOL_CALLS]"))
    assert [c.name for c in mistral.result().calls] == ["add"]


@pytest.mark.parametrize(("tools", "choice", "field"), [
    ([{"type": "function", "function": {"name": "x", "parameters": []}}], None, "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "x"}}] * 2, None, "tools.1.function"),
    ([{"type": "retrieval"}], None, "tools.0"),
    (None, "auto", "tool_choice"),
    ([{"type": "function", "function": {"name": "x"}}], "sometimes", "tool_choice"),
])
def test_bad_tools_name_the_field(tools, choice, field):
    with pytest.raises(ToolSpecError) as caught:
        check_tool_choice(choice, check_tools(tools) if tools is not None else None)
    assert caught.value.field == field
