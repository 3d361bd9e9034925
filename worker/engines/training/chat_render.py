"""Conversations as training examples: rendered with the base model's chat template, loss on assistant tokens only.

transformers' `return_assistant_tokens_mask` needs `{% generation %}` tags that most templates lack, so the
assistant spans are found by prefixes, as TRL does: the text of messages[:i] with the generation prompt ends
where assistant turn i starts, and the text of messages[:i + 1] ends where it stops (its end-of-turn marker
included, so the model learns to stop). Both must be prefixes of the whole conversation's text; a template
that rewrites earlier turns (some strip past reasoning) is refused. The whole text is tokenized once and a
token is in the loss when its first character lies in a span of a weight-1 assistant turn (character offsets,
so no merge across a span's edge can shift the mask). A conversation's `tools` go to the template's own `tools`
argument, and an assistant turn's tool calls are in its span (the template writes them in the model's call
format, the one serving parses); tool results are not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from core.tool_calls import template_messages

IGNORE = -100  # the label of tokens outside the loss (cross_entropy's ignore_index)


@dataclass(frozen=True)
class Rendered:
    """One example: token ids and labels of the same length (IGNORE outside the loss), not shifted."""

    input_ids: list[int]
    labels: list[int]

    @property
    def trained_tokens(self) -> int:
        """Tokens in the loss."""
        return sum(1 for label in self.labels if label != IGNORE)


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], *, max_length: int | None = None,
                last_only: bool = False, tools: list[dict[str, Any]] | None = None) -> Rendered:
    """Input ids and labels of one conversation; `last_only` trains the final assistant turn alone (DPO)."""
    weights = [m.get("weight", 1) for m in messages]
    turns = template_messages(list(messages))
    text = _template(tokenizer, turns, tools, generation_prompt=False)
    spans = []
    for i, message in enumerate(turns):
        if message["role"] != "assistant" or weights[i] != 1 or last_only and i != len(turns) - 1:
            continue
        before = _template(tokenizer, turns[:i], tools, generation_prompt=True)
        through = _template(tokenizer, turns[:i + 1], tools, generation_prompt=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError("the chat template does not render a conversation as a prefix of a longer one, so "
                             "the assistant turns cannot be located")
        spans.append((len(before), len(through)))
    return _label_spans(tokenizer, text, spans, add_special_tokens=False, max_length=max_length)


def render_completion(tokenizer: Any, prompt: str, completion: str, *, max_length: int | None = None) -> Rendered:
    """Prompt then completion as plain text (no template), the completion and an eos token in the loss."""
    rendered = _label_spans(tokenizer, prompt + completion, [(len(prompt), len(prompt) + len(completion))],
                            add_special_tokens=True, max_length=None)
    ids, labels = rendered.input_ids, rendered.labels
    if tokenizer.eos_token_id is not None:  # the model learns where a completion ends
        ids, labels = ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]
    return _cut(ids, labels, max_length)


def render_record(tokenizer: Any, fmt: str, record: dict[str, Any], *, max_length: int | None = None) -> Rendered:
    """One record of a chat or completion dataset (core.chat_data) as a training example."""
    if fmt == "chat":
        return render_chat(tokenizer, record["messages"], max_length=max_length, tools=record.get("tools"))
    if fmt == "completion":
        return render_completion(tokenizer, record["prompt"], record["completion"], max_length=max_length)
    raise ValueError(f"a {fmt} dataset has no single reply to train on; use it with method 'dpo'")


def render_preference(tokenizer: Any, record: dict[str, Any], *,
                      max_length: int | None = None) -> tuple[Rendered, Rendered]:
    """(preferred, non-preferred) of one preference record: the shared prompt, each reply in the loss."""
    prompt, tools = record["input"]["messages"], record["input"].get("tools")
    return tuple(  # type: ignore[return-value]
        render_chat(tokenizer, [*prompt, *record[key]], max_length=max_length, last_only=True, tools=tools)
        for key in ("preferred_output", "non_preferred_output"))


def _template(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
              generation_prompt: bool) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the base model's tokenizer has no chat template; use a chat model or a completion dataset")
    return tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def _label_spans(tokenizer: Any, text: str, spans: list[tuple[int, int]], *, add_special_tokens: bool,
                 max_length: int | None) -> Rendered:
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("chat training needs a fast tokenizer (character offsets); this one is a slow one")
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True, verbose=False)
    ids = list(encoded["input_ids"])
    labels = [IGNORE] * len(ids)
    for j, (start, end) in enumerate(encoded["offset_mapping"]):
        # Added special tokens (bos) have the empty offset (0, 0) and stay out of the loss.
        if end > start and any(lo <= start < hi for lo, hi in spans):
            labels[j] = ids[j]
    return _cut(ids, labels, max_length)


def _cut(ids: list[int], labels: list[int], max_length: int | None) -> Rendered:
    """Keep the first max_length tokens (the context a reply needs comes before it)."""
    if max_length is not None:
        ids, labels = ids[:max_length], labels[:max_length]
    return Rendered(input_ids=ids, labels=labels)


def collate(examples: Sequence[Rendered], pad_id: int) -> dict[str, Any]:
    """input_ids, attention_mask and labels tensors of examples padded on the right to the longest."""
    width = max(len(example.input_ids) for example in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
