"""The Responses API's items as the chat path's request, and the chat path's answer as Responses items.

/v1/responses runs on /v1/chat/completions' checks and worker (app/services/chat.py), as vLLM's serving_responses
builds on its chat layer: the input items become chat messages (function_call items an assistant's tool_calls,
function_call_output items tool messages, reasoning items dropped, as chat templates drop earlier turns' thinking),
flat function tools the chat's nested ones, text.format the chat's response_format. An error the chat path raises
names a chat field; `responses_field` names the Responses field the client sent instead. Plain functions, no I/O.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Literal

from pydantic import ValidationError

from app.schemas.chat import ChatCompletionRequest
from app.schemas.responses import ResponseCreate
from core.errors import ValidationFailed
from core.protocol import ChoiceOut, Usage

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}
PART_KEYS = {"input_text": {"type", "text"}, "output_text": {"type", "text", "annotations", "logprobs"}}
TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "name", "schema", "strict",
                                                                         "description"}}
ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def item_id(kind: str) -> str:
    """A new item's id, as OpenAI's look (msg_..., fc_..., rs_...)."""
    return f"{ID_PREFIX[kind]}_{secrets.token_hex(24)}"


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise ValidationFailed(field, "must be a string")
    return value


def _parts_text(content: Any, role: str, field: str) -> str:
    """A message's content as one text: a string, or text parts (input_text; an assistant's output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationFailed(field, "content is a string or a list of text parts")
    allowed = "output_text" if role == "assistant" else "input_text"
    accepted = {allowed, "input_text"}  # an assistant's parts may also be input_text
    texts = []
    for at, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in accepted:
            raise ValidationFailed(f"{field}.{at}.type", f"a {role} message's parts are {allowed} (no images, "
                                   "files or audio: the served models read text)")
        unknown = sorted(set(part) - PART_KEYS[kind])
        if unknown:
            raise ValidationFailed(f"{field}.{at}.{unknown[0]}", f"unknown field {unknown[0]!r}")
        texts.append(_text(part.get("text"), f"{field}.{at}.text"))
    return "".join(texts)


def _item(raw: Any, field: str) -> dict[str, Any]:
    """One input item checked and in its full shape, with an id (OpenAI gives every stored item one)."""
    if not isinstance(raw, dict):
        raise ValidationFailed(field, "each input item is an object")
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind not in ITEM_KEYS:
        raise ValidationFailed(f"{field}.type", "items are message, function_call, function_call_output or "
                               f"reasoning; {kind!r} is not supported")
    unknown = sorted(set(raw) - ITEM_KEYS[kind])
    if unknown:
        raise ValidationFailed(f"{field}.{unknown[0]}", f"unknown field {unknown[0]!r} of a {kind} item")
    given_id = raw.get("id")
    if given_id is not None:
        _text(given_id, f"{field}.id")
    out: dict[str, Any] = {"id": given_id or item_id(kind), "type": kind}
    if kind == "message":
        role = raw.get("role")
        if role not in MESSAGE_ROLES:
            raise ValidationFailed(f"{field}.role", f"role is one of {', '.join(MESSAGE_ROLES)}")
        text = _parts_text(raw.get("content"), role, f"{field}.content")
        part = "output_text" if role == "assistant" else "input_text"
        content: dict[str, Any] = {"type": part, "text": text}
        if role == "assistant":
            content.update(annotations=[], logprobs=[])
        out.update(role=role, content=[content], status=raw.get("status") or "completed")
    elif kind == "function_call":
        out.update(call_id=_text(raw.get("call_id"), f"{field}.call_id"), name=_text(raw.get("name"), f"{field}.name"),
                   arguments=_text(raw.get("arguments"), f"{field}.arguments"), status=raw.get("status") or "completed")
    elif kind == "function_call_output":
        output = raw.get("output")
        text = output if isinstance(output, str) else _parts_text(output, "tool", f"{field}.output")
        out.update(call_id=_text(raw.get("call_id"), f"{field}.call_id"), output=text,
                   status=raw.get("status") or "completed")
    else:
        out.update(summary=raw.get("summary") or [], content=raw.get("content") or [])
    return out


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as checked items in their full shape (text: one user message)."""
    if isinstance(value, str):
        return [_item({"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]},
                      "input")]
    if not value:
        raise ValidationFailed("input", "input is text or a non-empty list of items")
    return [_item(raw, f"input.{at}") for at, raw in enumerate(value)]


def item_text(item: dict[str, Any]) -> str:
    """A message item's text (its parts joined)."""
    return "".join(part.get("text", "") for part in item.get("content") or [])


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items (in their full shape) as chat messages: calls join the assistant turn before them, outputs are tool
    messages, reasoning is dropped."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": item_text(item)})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*(last.get("tool_calls") or []), call]
                last["content"] = last["content"] or None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as the chat's {"type": "function", "function": {...}}; none for an empty list
    (OpenAI's own answer to `tools: []`, which the Agents SDK sends for an agent without tools)."""
    if not tools:
        return None
    out = []
    for at, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ValidationFailed(f"tools.{at}.type", f"only function tools are served; {tool.get('type')!r} is "
                                   "not (no hosted tools on this server)")
        unknown = sorted(set(tool) - TOOL_KEYS)
        if unknown:
            raise ValidationFailed(f"tools.{at}.{unknown[0]}", f"unknown field {unknown[0]!r} of a function tool")
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses' tool_choice ({"type": "function", "name"}) as the chat's ({"type": "function", "function"})."""
    if not isinstance(value, dict):
        return value
    if value.get("type") != "function" or set(value) - {"type", "name"}:
        raise ValidationFailed("tool_choice", 'tool_choice is "none", "auto", "required" or {"type": "function", '
                               '"name": ...}')
    return {"type": "function", "function": {"name": value.get("name")}}


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as the chat's response_format."""
    if text is None:
        return None
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise ValidationFailed(f"text.{unknown[0]}", f"unknown field {unknown[0]!r}")
    if text.get("verbosity") not in (None, "medium"):
        raise ValidationFailed("text.verbosity", "verbosity is not supported (only null or medium)")
    spec = text.get("format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind not in FORMAT_KEYS:
        raise ValidationFailed("text.format.type", "type is text, json_object or json_schema")
    unknown = sorted(set(spec) - FORMAT_KEYS[kind])
    if unknown:
        raise ValidationFailed(f"text.format.{unknown[0]}", f"unknown field {unknown[0]!r}")
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if k != "type"}}
    return None if kind == "text" else {"type": kind}


def refuse_include(include: list[str] | None) -> None:
    """`include` (on create and on input items) names extra outputs; none is offered, so any is a 422."""
    if include:
        raise ValidationFailed("include", f"{include[0]!r} cannot be included: none of the extra outputs is offered")


def refuse_unsupported(body: ResponseCreate) -> None:
    """The Responses fields this server takes only at their neutral value: any other is a 422 naming it."""
    refuse_include(body.include)
    if body.background:
        raise ValidationFailed("background", "background responses are not supported: every response is answered "
                               "in its request")
    if body.reasoning and any(v is not None for v in body.reasoning.values()):
        raise ValidationFailed("reasoning", "reasoning settings are not supported: a thinking model's template "
                               'decides (chat_template_kwargs {"enable_thinking": false} turns it off)')
    unknown = sorted(set(body.stream_options or {}) - {"include_obfuscation"})
    if unknown:
        raise ValidationFailed(f"stream_options.{unknown[0]}", f"unknown field {unknown[0]!r}")


def chat_request(body: ResponseCreate, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request a Responses request runs as (`items`: the chain's earlier items, then this input)."""
    refuse_unsupported(body)
    values: dict[str, Any] = {
        "model": body.model, "messages": chat_messages(body.instructions, items),
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "tools": chat_tools(body.tools), "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls, "response_format": response_format(body.text),
        "chat_template_kwargs": body.chat_template_kwargs, "top_k": body.top_k,
        "repetition_penalty": body.repetition_penalty, "min_tokens": body.min_tokens, "ignore_eos": body.ignore_eos}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in values.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = responses_field(".".join(str(p) for p in first["loc"]))
        raise ValidationFailed(field, str(first["msg"])) from exc


_TOOL_FIELD = re.compile(r"^tools\.(\d+)\.function(\.|$)")


def responses_field(field: str | None) -> str | None:
    """The Responses request's name of a field the chat path names (its errors then name what the client sent)."""
    if field is None:
        return None
    if field.startswith("response_format"):
        return "text.format.schema" if field.endswith("json_schema.schema") else "text.format"
    if field in ("max_completion_tokens", "max_tokens"):
        return "max_output_tokens"
    if field.startswith("messages"):
        return "input"
    return _TOOL_FIELD.sub(lambda m: f"tools.{m.group(1)}" + m.group(2), field)


def response_status(finish_reason: str | None) -> Literal["completed", "incomplete"]:
    """A response's (and its open items') status from its choice's finish reason: the token limit leaves it
    incomplete."""
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(choice: ChoiceOut) -> list[dict[str, Any]]:
    """A finished chat choice as Responses output items: its reasoning, its message, then its function calls."""
    status = response_status(choice.finish_reason)
    items: list[dict[str, Any]] = []
    if choice.reasoning:
        items.append(reasoning_item(item_id("reasoning"), choice.reasoning, status))
    if choice.text or not choice.tool_calls:
        items.append(message_item(item_id("message"), choice.text, status))
    for call in choice.tool_calls or []:
        items.append(call_item(item_id("function_call"), call["id"], call["function"]["name"],
                               call["function"]["arguments"], "completed"))
    return items


def reasoning_item(id_: str, text: str | None, status: str) -> dict[str, Any]:
    """A reasoning output item (the template's thinking section as reasoning_text)."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": id_, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(id_: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message output item (one output_text part; none while it opens)."""
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": id_, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(id_: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """A function_call output item."""
    return {"id": id_, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def response_usage(usage: Usage) -> dict[str, Any]:
    """OpenAI's Responses usage of the chat path's."""
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
