"""Tool calls and reasoning in a chat template's own format: the tool specs, the family, and parsing the output.

A model calls tools in the format its chat template renders them, so the family is read from the template's text,
never from a flag (as vLLM's tool parsers, one per family): Hermes / Qwen 2.5 wrap each call in
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, Llama 3.1 writes the bare object with
`"parameters"`, Mistral a list after `[TOOL_CALLS]`. The worker constrains every call to that exact text
(core/tool_grammar.py), with the separators `tojson` renders (`", "`, `": "`), so the parsers here read one
known shape and never have to guess. A template's thinking section (Qwen 3's `<think>...</think>`) is split off
as the reasoning. `ChoiceParser` turns a choice's text deltas into content, reasoning and tool-call deltas as
they stream; its ids and final calls are those of the whole answer. Imports neither torch nor transformers.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ToolSpecError(ValueError):
    """A tool, tool choice or tool call that is not OpenAI's shape; `field` names where, below the request."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Family:
    """How one template family writes calls: `open` + (`prefix` call `suffix`) joined by `between` + `close`."""

    name: str
    marker: str  # the text that starts the calls (the grammar forbids it in free text)
    args_key: str
    open: str = ""
    prefix: str = ""
    suffix: str = ""
    between: str = ""
    close: str = ""

    def call_text(self, name: str, arguments: str) -> str:
        """One call's object as the template renders it (arguments: JSON text)."""
        return f'{{"name": {json.dumps(name)}, "{self.args_key}": {arguments}}}'


HERMES = Family("hermes", "<tool_call>", "arguments", prefix="<tool_call>\n", suffix="\n</tool_call>", between="\n")
LLAMA3 = Family("llama3_json", "{", "parameters", between="; ")
MISTRAL = Family("mistral", "[TOOL_CALLS]", "arguments", open="[TOOL_CALLS] [", between=", ", close="]")
FAMILIES = {f.name: f for f in (HERMES, LLAMA3, MISTRAL)}


def family_of(template: str | None) -> Family | None:
    """The tool-call family a chat template renders, by its own text; None when it renders no tool calls."""
    if not template or "tool" not in template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if '"parameters"' in template or "<|python_tag|>" in template:
        return LLAMA3
    return None


def thinks(template: str | None) -> bool:
    """Whether a chat template has a thinking section (Qwen 3's `<think>`)."""
    return bool(template) and THINK_CLOSE in str(template)


def check_tools(value: Any, where: str = "tools") -> list[dict[str, Any]]:
    """OpenAI's function tools, checked; each returned as {"type": "function", "function": {name, ...}}."""
    if not isinstance(value, list) or not value:
        raise ToolSpecError("tools must be a non-empty list of function tools", where)
    if len(value) > MAX_TOOLS:
        raise ToolSpecError(f"at most {MAX_TOOLS} tools", where)
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(value):
        at = f"{where}.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolSpecError('each tool is {"type": "function", "function": {"name": ..., "parameters": {...}}}', at)
        unknown = sorted(set(tool) - {"type", "function"})
        if unknown:
            raise ToolSpecError(f"unknown field {unknown[0]!r}", at)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolSpecError("function.name must be 1-64 letters, digits, underscores or dashes", f"{at}.function")
        if name in seen:
            raise ToolSpecError(f"two tools are named {name!r}", f"{at}.function")
        seen.add(name)
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ToolSpecError(f"unknown field {unknown[0]!r}", f"{at}.function")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolSpecError("parameters must be a JSON schema object", f"{at}.function.parameters")
        if "description" in function and not isinstance(function["description"], str):
            raise ToolSpecError("description must be a string", f"{at}.function.description")
        out.append({"type": "function", "function": {**function, "parameters": parameters}})
    return out


def check_tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> str:
    """OpenAI's tool_choice as "none", "auto", "required" or the one function's name; checked against tools."""
    if value is None:
        return "auto" if tools else "none"
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise ToolSpecError(f"tool_choice {value!r} needs tools", "tool_choice")
        return str(value)
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolSpecError('tool_choice is "none", "auto", "required" or {"type": "function", "function": '
                            '{"name": ...}}', "tool_choice")
    if name not in {t["function"]["name"] for t in tools or []}:
        raise ToolSpecError(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
    return name


def check_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls in OpenAI's shape: ids, function names and arguments as JSON text."""
    if not isinstance(value, list) or not value:
        raise ToolSpecError("tool_calls must be a non-empty list", where)
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise ToolSpecError('each call is {"id", "type": "function", "function": {"name", "arguments"}}', at)
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise ToolSpecError("id must be a non-empty string", f"{at}.id")
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not NAME.match(function["name"]):
            raise ToolSpecError("function.name must be a tool's name", f"{at}.function")
        arguments = function.get("arguments")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ToolSpecError("function.arguments must be a JSON object as a string", f"{at}.function.arguments")
    return value


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: each call's arguments as an object (templates apply `tojson`)."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None and k != "weight"}
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {"id": c.get("id"), "type": "function",
                 "function": {"name": c["function"]["name"], "arguments": _as_object(c["function"]["arguments"])}}
                for c in message["tool_calls"]]
        if message.get("role") == "assistant" and message.get("content") is None:
            message["content"] = ""
        out.append(message)
    return out


def _as_object(arguments: Any) -> Any:
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def call_id() -> str:
    """A tool call's id, as OpenAI's look."""
    return "call_" + secrets.token_hex(12)


@dataclass
class Call:
    """One call as parsed so far: its id, name and arguments text (complete once `done`)."""

    id: str
    name: str
    arguments: str = ""
    done: bool = False


@dataclass
class Parsed:
    """A choice's text split into reasoning, content and calls (so far, when streaming)."""

    reasoning: str = ""
    content: str = ""
    calls: list[Call] = field(default_factory=list)
    in_calls: bool = False  # the text started calls (so no content follows)


def _split_reasoning(text: str, started: bool, final: bool) -> tuple[str | None, str, bool]:
    """(reasoning, the rest, whether the reasoning is over); reasoning None when there is none."""
    if not started:
        stripped = text.lstrip()
        if stripped.startswith(THINK_OPEN):
            text, started = stripped[len(THINK_OPEN):], True
        elif not final and THINK_OPEN.startswith(stripped):
            return "", "", False  # maybe the start of <think>: wait
        else:
            return None, text, True
    end = text.find(THINK_CLOSE)
    if end >= 0:
        return text[:end].strip("\n"), text[end + len(THINK_CLOSE):].lstrip(), True
    if final:
        return text.strip("\n"), "", False
    return _hold_back(text, THINK_CLOSE).strip("\n"), "", False  # newlines before </think> are not reasoning


def _hold_back(text: str, marker: str) -> str:
    """`text` less a tail that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return text[:-n]
    return text


def _json_end(text: str, start: int) -> int | None:
    """The index after the JSON object starting at `start`, or None while it is open (string-aware)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _parse_calls(family: Family, text: str, ids: list[str]) -> list[Call] | None:
    """The calls written in `text` (the family's exact shape), partial at the end; None if it is not calls."""
    at = 0
    text = _strip_special_open(family, text)
    if family.open:
        if not family.open.startswith(text[:len(family.open)]):
            return None
        at = len(family.open)
        if len(text) < at:
            return []
    calls: list[Call] = []
    while at < len(text):
        if calls:
            sep = family.suffix + family.between
            tail = text[at:at + len(sep)]
            if not sep.startswith(tail) and not (family.suffix + family.close).startswith(tail):
                return None
            if not text.startswith(sep, at):
                break  # the suffix, the close, or a separator still arriving
            at += len(sep)
        head = family.prefix + '{"name": "'
        piece = text[at:at + len(head)]
        if not head.startswith(piece):
            return None
        if len(piece) < len(head):
            break
        name_end = text.find('"', at + len(head))
        if name_end < 0:
            break
        name = text[at + len(head):name_end]
        if len(ids) <= len(calls):
            ids.append(call_id())
        call = Call(ids[len(calls)], name)
        calls.append(call)
        key = f', "{family.args_key}": '
        args_at = name_end + 1 + len(key)
        if not text.startswith(key, name_end + 1) or args_at >= len(text):
            break
        end = _json_end(text, args_at)
        call.arguments = text[args_at:end]
        if end is None:
            break
        call.done = end < len(text) and text[end] == "}"
        if not call.done:
            break
        at = end + 1
    return calls


def _strip_special_open(family: Family, text: str) -> str:
    """Mistral's [TOOL_CALLS] is a special token that decoding drops: put it back when the list starts without it."""
    if family is MISTRAL and not text.startswith(family.marker) and text.lstrip().startswith("["):
        return family.marker + " " + text.lstrip()
    return text


@dataclass
class ChoiceParser:
    """One choice's text, fed as it streams, into content, reasoning and tool-call deltas.

    `family` is set when the answer may hold calls; `reasoning` when the template thinks (`in_think`: the prompt
    already opened the thinking section). The grammar guarantees the shapes read here.
    """

    family: Family | None
    reasoning: bool
    in_think: bool = False
    text: str = ""
    _sent: Parsed = field(default_factory=Parsed)
    _ids: list[str] = field(default_factory=list)

    def parse(self, final: bool = False) -> Parsed:
        """The text so far as reasoning, content and calls (`final`: nothing is held back)."""
        parsed = Parsed()
        rest = self.text
        if self.reasoning:
            reasoning, rest, _ = _split_reasoning(rest, self.in_think, final)
            parsed.reasoning = reasoning or ""
        if self.family is None:
            parsed.content = rest
            return parsed
        stripped = rest.lstrip() if self.family is not LLAMA3 else rest
        starts = self.family.open or self.family.prefix or self.family.marker
        if not final and (not stripped or starts.startswith(stripped) and len(stripped) < len(starts)):
            return parsed  # maybe the start of a call: wait
        calls = _parse_calls(self.family, stripped, self._ids) if stripped.startswith(
            (self.family.marker, "[")) else None
        if calls is None:
            parsed.content = rest
            return parsed
        if final:  # cut short (max_tokens): the complete calls stand, a cut one is no call and no content either
            calls = [c for c in calls if c.done]
        parsed.in_calls, parsed.calls = True, calls
        return parsed

    def feed(self, delta: str) -> tuple[str, str, list[dict[str, Any]]]:
        """(content delta, reasoning delta, tool-call deltas in OpenAI's streaming shape) for new text."""
        self.text += delta
        return self._diff(self.parse())

    def finish(self) -> tuple[str, str, list[dict[str, Any]]]:
        """The deltas held back until the end."""
        return self._diff(self.parse(final=True))

    def _diff(self, now: Parsed) -> tuple[str, str, list[dict[str, Any]]]:
        sent = self._sent
        content = now.content[len(sent.content):] if now.content.startswith(sent.content) else ""
        reasoning = now.reasoning[len(sent.reasoning):] if now.reasoning.startswith(sent.reasoning) else ""
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(now.calls):
            if index >= len(sent.calls):
                deltas.append({"index": index, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                continue
            before = sent.calls[index].arguments
            if call.arguments != before and call.arguments.startswith(before):
                deltas.append({"index": index, "function": {"arguments": call.arguments[len(before):]}})
        self._sent = Parsed(sent.reasoning + reasoning, sent.content + content,
                            [Call(c.id, c.name, c.arguments, c.done) for c in now.calls], now.in_calls)
        return content, reasoning, deltas

    def result(self) -> Parsed:
        """The whole answer: its content, reasoning and complete calls (ids as streamed)."""
        return self.parse(final=True)
