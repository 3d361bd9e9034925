"""Chat datasets in OpenAI's fine-tuning formats: conversations, preference pairs and prompt/completion pairs.

A `.jsonl` upload whose first record has `messages` is a chat dataset (format "chat"); one with
`preferred_output` is a preference dataset ("preference", for DPO); one with `prompt` and `completion` is a
completion dataset ("completion"); one whose `messages` end before an assistant turn is a prompts dataset
("prompts", for reinforcement fine-tuning: the model answers each, a grader scores the answer against the record's
other fields). Every other JSON Lines file stays a table. Each line is checked as it streams
(roles, string contents, an assistant turn to learn from, `weight` 0 or 1 on assistant turns only), and every
defect is a ValidationFailed('file', 'line N: ...'). Whether the base model's chat template renders a
conversation is checked by the worker, which has the tokenizer (worker.engines.training.chat_render).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from core.batch_data import BATCH_FORMAT, BatchReader
from core.errors import ValidationFailed
from core.tabular import RowReader, TableSummary, Value, json_objects, short, summarize_file

ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = {"role", "content", "weight", "name"}
MAX_MESSAGES = 1000
COLUMNS = {
    "chat": ["messages"],
    "preference": ["input", "preferred_output", "non_preferred_output"],
    "completion": ["prompt", "completion"],
    "prompts": ["messages"],
}
CHAT_FORMATS = tuple(COLUMNS)
MAX_LENGTH = 1024  # tokens per rendered conversation when a job gives no block_size (admission estimates it too)
# Where an upload's record sizes are kept in the dataset's column_stats (no chat column has this name).
RECORDS_STATS = "_records"
# A chat template's own tokens: role headers and end-of-turn markers per message (Llama 3 uses 5, ChatML 5, Llama 2
# fewer), and once per conversation a BOS and a default system prompt some templates add (SmolLM2's is 20 tokens).
TEMPLATE_TOKENS_PER_MESSAGE = 16
TEMPLATE_TOKENS = 128
_SNIFF_BYTES = 64 * 1024 * 1024  # the first record decides the format; a longer first line stays a table


class RecordError(ValueError):
    """One record's defect, without the line number (the reader adds it)."""


def detect_format(path: Path, fmt: str) -> str:
    """The chat format of a JSON Lines file by its first record's keys, else `fmt` unchanged."""
    if fmt != "jsonl":
        return fmt
    with open(path, "rb") as stream:
        text = io.TextIOWrapper(stream, encoding="utf-8-sig", errors="replace")
        for line in text:
            if len(line) > _SNIFF_BYTES:
                return fmt
            if line.strip():
                return _format_of(line) or fmt
    return fmt


def _format_of(line: str) -> str | None:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None  # the table reader names the defect
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        messages = record["messages"]
        last = messages[-1] if isinstance(messages, list) and messages else None
        return "prompts" if isinstance(last, dict) and last.get("role") in ("user", "system") else "chat"
    if "preferred_output" in record or "non_preferred_output" in record:
        return "preference"
    if "prompt" in record and "completion" in record:
        return "completion"
    return None


def check_messages(value: Any, where: str = "messages") -> list[dict[str, Any]]:
    """A list of {role, content[, weight][, name]} messages, checked; returns them as given."""
    if not isinstance(value, list) or not value:
        raise RecordError(f"{where} must be a non-empty list of messages")
    if len(value) > MAX_MESSAGES:
        raise RecordError(f"{where} has {len(value)} messages; the limit is {MAX_MESSAGES}")
    for i, message in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(message, dict):
            raise RecordError(f"{at} must be an object with role and content")
        unknown = sorted(set(message) - MESSAGE_KEYS)
        if unknown:
            hint = " (tool calls are not supported)" if {"tool_calls", "function_call"} & set(unknown) else ""
            raise RecordError(f"{at} has unknown field {short(unknown[0])}{hint}")
        role = message.get("role")
        if role not in ROLES:
            raise RecordError(f"{at}.role must be one of {', '.join(ROLES)}, got {short(role)}")
        content = message.get("content")
        if not isinstance(content, str):
            raise RecordError(f"{at}.content must be a string")
        if role == "assistant" and not content.strip():
            raise RecordError(f"{at}.content is empty; an assistant turn needs text to learn")
        if "name" in message and not (isinstance(message["name"], str) and 0 < len(message["name"]) <= 64):
            raise RecordError(f"{at}.name must be a string of 1-64 characters")
        if "weight" in message:
            weight = message["weight"]
            if role != "assistant":
                raise RecordError(f"{at}.weight is allowed on assistant messages only")
            if isinstance(weight, bool) or weight not in (0, 1):
                raise RecordError(f"{at}.weight must be 0 or 1, got {short(weight)}")
    return value


def check_chat(record: dict[str, Any]) -> dict[str, Any]:
    """{"messages": [...]} with at least one assistant turn of weight 1."""
    _only_keys(record, {"messages"})
    messages = check_messages(record.get("messages"))
    if not any(m["role"] == "assistant" and m.get("weight", 1) == 1 for m in messages):
        raise RecordError("messages has no assistant message to learn from (each has weight 0, or there is none)")
    return record


def check_preference(record: dict[str, Any]) -> dict[str, Any]:
    """{"input": {"messages": [...]}, "preferred_output": [assistant], "non_preferred_output": [assistant]}."""
    _only_keys(record, set(COLUMNS["preference"]))
    prompt = record.get("input")
    if not isinstance(prompt, dict) or "messages" not in prompt:
        raise RecordError("input must be an object with messages")
    if set(prompt) - {"messages"}:
        raise RecordError(f"input has unknown field {short(sorted(set(prompt) - {'messages'})[0])}")
    check_messages(prompt["messages"], "input.messages")
    for key in ("preferred_output", "non_preferred_output"):
        output = check_messages(record.get(key), key)
        if len(output) != 1 or output[0]["role"] != "assistant" or "weight" in output[0]:
            raise RecordError(f"{key} must hold exactly one assistant message (without weight)")
    return record


def check_completion(record: dict[str, Any]) -> dict[str, Any]:
    """{"prompt": str, "completion": str}: the loss covers the completion only."""
    _only_keys(record, set(COLUMNS["completion"]))
    if not isinstance(record.get("prompt"), str):
        raise RecordError("prompt must be a string")
    completion = record.get("completion")
    if not isinstance(completion, str) or not completion.strip():
        raise RecordError("completion must be a non-empty string")
    return record


def check_prompts(record: dict[str, Any]) -> dict[str, Any]:
    """{"messages": [...ending with a user or system turn], any other fields a grader refers to (item.*)}."""
    messages = check_messages(record.get("messages"))
    if messages[-1]["role"] == "assistant":
        raise RecordError("messages ends with an assistant turn; a prompt ends with the turn the model answers")
    if any("weight" in message for message in messages):
        raise RecordError("weight has no meaning in a prompt (the sampled answers are what is trained)")
    return record


CHECKS = {"chat": check_chat, "preference": check_preference, "completion": check_completion,
          "prompts": check_prompts}


def _text_bytes(messages: list[dict[str, Any]]) -> int:
    return sum(len(m["content"].encode()) + len(str(m.get("name", "")).encode()) for m in messages)


def record_tokens_bound(fmt: str, record: dict[str, Any]) -> int:
    """At most how many tokens a checked record renders to with any tokenizer and chat template.

    Byte-level BPE (GPT-2, Llama 3, Qwen) never makes more tokens than UTF-8 bytes, nor does SentencePiece with
    byte fallback (Llama 2, Mistral: at most one token per byte, plus the prefix space) or WordPiece; the template
    adds its markers per message (TEMPLATE_TOKENS_PER_MESSAGE) and once (TEMPLATE_TOKENS). A preference record
    renders as two sequences, each the prompt and one output: the longer counts.
    """
    if fmt == "completion":
        return len(record["prompt"].encode()) + len(record["completion"].encode()) + 2 + TEMPLATE_TOKENS
    if fmt == "preference":
        prompt = record["input"]["messages"]
        outputs = [record["preferred_output"], record["non_preferred_output"]]
        messages = len(prompt) + 1
        text = _text_bytes(prompt) + max(_text_bytes(output) for output in outputs)
    else:
        messages, text = len(record["messages"]), _text_bytes(record["messages"])
    return text + messages * (TEMPLATE_TOKENS_PER_MESSAGE + 1) + TEMPLATE_TOKENS


def longest_tokens(column_stats: dict[str, Any] | None) -> int | None:
    """The longest record's token bound a dataset's validation stored (None for tables and older uploads)."""
    entry = (column_stats or {}).get(RECORDS_STATS)
    value = entry.get("max_tokens") if isinstance(entry, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _only_keys(record: dict[str, Any], allowed: set[str]) -> None:
    missing = sorted(key for key in allowed if key not in record)
    if missing:
        raise RecordError(f"field {short(missing[0])} is missing")
    unknown = sorted(set(record) - allowed)
    if unknown:
        raise RecordError(f"unknown field {short(unknown[0])}; a line holds only {', '.join(sorted(allowed))}")


class ChatReader(RowReader):
    """Records of a chat, preference or completion file, each checked; `line_numbers` follows the records."""

    def __init__(self, stream: BinaryIO, fmt: str, *, max_rows: int | None = None) -> None:
        super().__init__(stream, fmt, max_rows=max_rows)
        self.columns = list(COLUMNS[fmt])
        self.line_no = 0

    def _rows(self, text: io.TextIOWrapper) -> Iterator[dict[str, Value]]:
        check = CHECKS[self.format]
        for line_no, record in json_objects(text):
            self.line_no = line_no
            try:
                yield check(record)
            except RecordError as exc:
                raise ValidationFailed("file", f"line {line_no}: {exc}") from exc


def open_rows(stream: BinaryIO, fmt: str, *, max_rows: int | None = None,
              max_columns: int | None = None) -> RowReader:
    """The reader of a stored dataset's format: chat records or table rows."""
    if fmt in CHAT_FORMATS:
        return ChatReader(stream, fmt, max_rows=max_rows)
    if fmt == BATCH_FORMAT:
        return BatchReader(stream, max_rows=max_rows)
    return RowReader(stream, fmt, max_rows=max_rows, max_columns=max_columns)


def summarize_upload(path: Path, fmt: str, *, max_rows: int | None = None,
                     max_columns: int | None = None) -> TableSummary:
    """Validate an upload in one streaming pass, as a chat dataset when its first record is one, else a table."""
    fmt = detect_format(path, fmt)
    if fmt not in CHAT_FORMATS:
        return summarize_file(path, fmt, max_rows=max_rows, max_columns=max_columns)
    count, longest = 0, 0
    with open(path, "rb") as stream:
        for record in ChatReader(stream, fmt, max_rows=max_rows):
            count += 1
            longest = max(longest, record_tokens_bound(fmt, record))
    return TableSummary(format=fmt, columns=list(COLUMNS[fmt]), rows=count,
                        stats={RECORDS_STATS: {"max_tokens": longest}})


def read_records(path: Path) -> tuple[str, list[tuple[int, dict[str, Any]]]]:
    """A stored chat dataset's format and its checked records with their line numbers (for the worker)."""
    fmt = detect_format(Path(path), "jsonl")
    if fmt not in CHAT_FORMATS:
        raise ValidationFailed("file", f"{Path(path).name} is not a chat, preference or completion dataset")
    records: list[tuple[int, dict[str, Any]]] = []
    with open(path, "rb") as stream:
        reader = ChatReader(stream, fmt)
        for record in reader:
            records.append((reader.line_no, record))
    return fmt, records
