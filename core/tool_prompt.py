"""The default tool prompt: tools on a model whose chat template renders none, in the Hermes / Qwen 2.5 form.

Most chat templates have no tool section (core.tool_calls.family_of is None). For those the worker renders the tools
itself, as llama.cpp's generic handler and the Hermes function-calling prompt do, and the template only ever sees
plain system, user and assistant messages: the tools' JSON in a system message (the client's own system message
first, when it sends one) with Qwen 2.5's instructions to call them as `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`; an assistant's earlier calls as that text; tool results as a user message of
`<tool_response>\\n...\\n</tool_response>` blocks, consecutive results in one message. The calls are then constrained,
parsed and streamed as the HERMES family's (core.tool_grammar, core.tool_calls), whatever the model.
"""

from __future__ import annotations

import json
from typing import Any

from core.tool_calls import HERMES

_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
         "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
         "<tool_call></tool_call> XML tags:\n<tool_call>\n"
         '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The system text that lists `tools` (one JSON object a line, as templates' `tojson` writes) and the call form."""
    return _HEAD + "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools) + _TAIL


def calls_text(calls: list[dict[str, Any]]) -> str:
    """An assistant's calls (OpenAI's shape, arguments as an object or JSON text) as the model writes them."""
    texts = []
    for call in calls:
        arguments = call["function"]["arguments"]
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        texts.append(HERMES.prefix + HERMES.call_text(call["function"]["name"],
                                                      json.dumps(arguments, ensure_ascii=False)) + HERMES.suffix)
    return HERMES.between.join(texts)


def plain_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   system_role: bool = True) -> list[dict[str, Any]]:
    """`messages` as system, user and assistant text only, with `tools` (None: no tools prompt) listed in the system
    message; `system_role` False puts that text before the first user message instead (a template that refuses a
    system message)."""
    out: list[dict[str, Any]] = []
    previous = None
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if previous == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif role == "assistant" and message.get("tool_calls"):
            text = calls_text(message["tool_calls"])
            out.append({"role": role, "content": f"{content}\n{text}" if content else text})
        else:
            out.append({"role": role, "content": content})
        previous = role
    if not tools:
        return out
    prompt = tools_prompt(tools)
    if out and out[0]["role"] == "system":
        prompt = out.pop(0)["content"] + "\n\n" + prompt
    if system_role:
        return [{"role": "system", "content": prompt}, *out]
    first = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
    if first is None:
        return [{"role": "user", "content": prompt}, *out]
    out[first] = {"role": "user", "content": prompt + "\n\n" + out[first]["content"]}
    return out
