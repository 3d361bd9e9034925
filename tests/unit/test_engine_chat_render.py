"""Chat rendering for training: the label mask covers exactly the assistant turns of weight 1 (with their
end-of-turn marker), for Llama 3's and ChatML's templates, multi-turn, weight 0 and truncated conversations."""

from __future__ import annotations

import pytest

from tests.tiny_chat import CHATML_TEMPLATE, LLAMA3_TEMPLATE, build_chat_tokenizer
from worker.engines.training.chat_render import IGNORE, render_chat, render_completion, render_preference, render_record

END = {LLAMA3_TEMPLATE: "<|eot_id|>", CHATML_TEMPLATE: "<|im_end|>\n"}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there!"},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "I am fine, thank you.", "weight": 0},
    {"role": "user", "content": "Name a colour"},
    {"role": "assistant", "content": "Blue.", "weight": 1},
]


def _runs(tokenizer, rendered) -> list[str]:
    """The text of each maximal run of tokens in the loss."""
    runs: list[list[int]] = []
    previous = False
    for token, label in zip(rendered.input_ids, rendered.labels, strict=True):
        inside = label != IGNORE
        if inside:
            assert label == token
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = inside
    return [tokenizer.decode(run) for run in runs]


@pytest.mark.parametrize("template", [LLAMA3_TEMPLATE, CHATML_TEMPLATE], ids=["llama3", "chatml"])
def test_mask_covers_exactly_the_weighted_assistant_turns(template):
    tokenizer = build_chat_tokenizer(template)
    rendered = render_chat(tokenizer, CONVERSATION)
    # The same ids transformers gives for the whole conversation: rendering changes nothing but the labels.
    assert rendered.input_ids == tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert _runs(tokenizer, rendered) == [f"Hello there!{END[template]}", f"Blue.{END[template]}"]
    trained = tokenizer(f"Hello there!{END[template]}Blue.{END[template]}", add_special_tokens=False)["input_ids"]
    assert rendered.trained_tokens == len(trained)


@pytest.mark.parametrize("template", [LLAMA3_TEMPLATE, CHATML_TEMPLATE], ids=["llama3", "chatml"])
def test_single_turn_and_truncation(template):
    tokenizer = build_chat_tokenizer(template)
    turn = CONVERSATION[1:3]
    full = render_chat(tokenizer, turn)
    assert _runs(tokenizer, full) == [f"Hello there!{END[template]}"]
    prompt = len(tokenizer.apply_chat_template(turn[:1], add_generation_prompt=True, return_dict=False))
    assert all(label == IGNORE for label in full.labels[:prompt]) and all(
        label != IGNORE for label in full.labels[prompt:])
    cut = render_chat(tokenizer, turn, max_length=prompt + 2)
    assert cut.input_ids == full.input_ids[:prompt + 2] and cut.trained_tokens == 2
    assert render_chat(tokenizer, turn, max_length=prompt).trained_tokens == 0


def test_preference_trains_the_final_reply_only():
    tokenizer = build_chat_tokenizer()
    record = {"input": {"messages": CONVERSATION[:5] + [CONVERSATION[5]]},
              "preferred_output": [{"role": "assistant", "content": "Blue."}],
              "non_preferred_output": [{"role": "assistant", "content": "Seven"}]}
    chosen, rejected = render_preference(tokenizer, record)
    assert _runs(tokenizer, chosen) == ["Blue.<|eot_id|>"] and _runs(tokenizer, rejected) == ["Seven<|eot_id|>"]
    shared = len(tokenizer.apply_chat_template(record["input"]["messages"], add_generation_prompt=True,
                                                  return_dict=False))
    assert chosen.input_ids[:shared] == rejected.input_ids[:shared]


def test_completion_trains_the_completion_and_eos():
    tokenizer = build_chat_tokenizer()
    rendered = render_record(tokenizer, "completion", {"prompt": "What is two plus two?", "completion": " Four."})
    assert _runs(tokenizer, rendered) == [" Four.<|eot_id|>"]
    assert tokenizer.decode(rendered.input_ids) == "What is two plus two? Four.<|eot_id|>"
    assert render_completion(tokenizer, "Hi", " there", max_length=1).trained_tokens == 0


def test_templates_that_cannot_be_split_are_refused():
    tokenizer = build_chat_tokenizer()
    # A template that marks the last turn differently rewrites the earlier text when a turn is added.
    tokenizer.chat_template = ("{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m['content'] }}"
                               "{% endfor %}")
    with pytest.raises(ValueError, match="prefix"):
        render_chat(tokenizer, CONVERSATION)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(tokenizer, CONVERSATION)
    with pytest.raises(ValueError, match="dpo"):
        render_record(tokenizer, "preference", {})


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
TOOL_TURNS = [{"role": "user", "content": "Weather in Rome?"},
              {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
              {"role": "assistant", "content": "Sunny."}]


@pytest.mark.parametrize("family", ["qwen25", "llama31", "mistral"])
def test_tool_calls_are_trained_in_the_templates_own_format(family):
    """The tools go to the template; each call is in the loss as the template writes it (the format serving
    parses), the tool's result is not."""
    from core.tool_calls import FAMILIES, family_of
    from tests.tiny_tools import TEMPLATES

    tokenizer = build_chat_tokenizer(TEMPLATES[family])
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    rendered = render_chat(tokenizer, TOOL_TURNS, tools=TOOLS)
    assert tokenizer.decode(rendered.input_ids).count('"get_weather"') == 2  # the tool's spec and the call
    runs = _runs(tokenizer, rendered)
    call = FAMILIES[family_of(TEMPLATES[family]).name]
    written = call.open + call.prefix + call.call_text("get_weather", '{"city": "Rome"}') + call.suffix + call.close
    assert len(runs) == 2 and written in runs[0] and "sunny" not in "".join(runs)
    assert runs[1].startswith(("Sunny.", " Sunny."))


def test_preference_pairs_may_carry_tools():
    from tests.tiny_tools import QWEN25

    tokenizer = build_chat_tokenizer(QWEN25)
    record = {"input": {"messages": TOOL_TURNS[:1], "tools": TOOLS},
              "preferred_output": [{"role": "assistant", "tool_calls": [CALL]}],
              "non_preferred_output": [{"role": "assistant", "content": "No idea."}]}
    preferred, rejected = render_preference(tokenizer, record)
    assert _runs(tokenizer, preferred) == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
                                           '</tool_call><|im_end|>\n']
    assert "# Tools" in tokenizer.decode(rejected.input_ids)
