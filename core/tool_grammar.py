"""The llguidance Lark grammar of a chat answer: reasoning first, then free text, tool calls or structured output.

With `tool_choice` "required" or a named function the whole answer is calls; with "auto" it is free text that
never writes the family's call marker, or, once it starts with the marker, only calls of the tools by name whose
arguments match each tool's JSON schema (`%json`, with the separators templates' `tojson` writes, so a trained
model's greedy calls pass the grammar unchanged), bounded as structured output is (core.schema_bounds) so a small model
cannot loop inside a number. With a response_format beside the tools, "auto" allows that format's answer instead
of free text. A thinking section comes first, when the template has one,
and everything else applies after it ends. A marker the tokenizer holds as one token may be written either as
that token or as its text (`<[id]> | "text"`): llguidance sees added tokens as special ones.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from core.protocol import Constraint, ValueBounds
from core.schema_bounds import bounded_schema
from core.tool_calls import LLAMA3, THINK_CLOSE, THINK_OPEN, Family

_SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", THINK_OPEN, THINK_CLOSE)


def _literal(text: str, token_ids: Mapping[str, int]) -> str:
    """A Lark sequence for `text`, each marker in it allowed as its own token too."""
    parts = re.split("(" + "|".join(re.escape(m) for m in MARKERS) + ")", text)
    items = []
    for part in parts:
        if not part:
            continue
        if part in token_ids:
            items.append(f"(<[{token_ids[part]}]> | {json.dumps(part)})")
        else:
            items.append(json.dumps(part))
    return " ".join(items) or '""'


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _SEPARATORS})


def _without(marker: str) -> str:
    """A free-text lexeme that never contains `marker`."""
    escaped = re.escape(marker).replace("/", "\\/")
    return f"/(?s:.*)/ & ~/(?s:.*){escaped}(?s:.*)/"


def tool_rules(family: Family, tools: list[dict[str, Any]], choice: str, parallel: bool,
               token_ids: Mapping[str, int], *, bounds: ValueBounds | None = None,
               answer: Constraint | None = None) -> list[str]:
    """Rules whose `body` is the answer under `choice` ("auto", "required" or a function's name): each call's
    arguments held to `bounds` where its schema leaves them open; under "auto" with an `answer` constraint (a
    response_format), the text that is not calls is that constraint's."""
    names = [t["function"]["name"] for t in tools]
    chosen = names if choice in ("auto", "required") else [choice]
    rules = []
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name not in chosen:
            continue
        head = family.call_text(name, "").removesuffix("}")  # '{"name": "f", "arguments": '
        rules.append(f"fn_{i}: {_literal(head, token_ids)} args_{i} \"}}\"")
        schema = tool["function"].get("parameters") or {"type": "object"}
        if bounds is not None:
            schema = bounded_schema(schema, **bounds.model_dump())
        rules.append(f"args_{i}: {_json(schema)}")
    rules.append("fn: " + " | ".join(f"fn_{i}" for i, t in enumerate(tools) if t["function"]["name"] in chosen))
    rules.append(f"call: {_literal(family.prefix, token_ids)} fn {_literal(family.suffix, token_ids)}")
    many = parallel and choice in ("auto", "required")
    more = f" ({_literal(family.between, token_ids)} call)*" if many else ""
    rules.append(f"calls: {_literal(family.open, token_ids)} call{more} {_literal(family.close, token_ids)}")
    if choice != "auto":
        rules.append("body: calls")
    elif answer is not None:
        rules += ["body: answer | calls", *constraint_rules(answer, "answer")]
    elif family is LLAMA3:  # no marker: an answer that starts with "{" is a call
        rules += ["body: TEXT | calls", "TEXT: /(?s:[^{].*)?/"]
    else:
        rules += ["body: TEXT | calls", f"TEXT: {_without(family.marker)}"]
    return rules


def constraint_rules(constraint: Constraint, name: str = "body") -> list[str]:
    """Rules whose `name` is a structured-output constraint (to follow a thinking section, or beside calls)."""
    if constraint.kind == "json_schema":
        return [f"{name}: {_json(json.loads(constraint.spec))}"]
    if constraint.kind == "json_object":
        return [f"{name}: {_json({'type': 'object'})}"]
    if constraint.kind == "regex":
        return [f"{name}: " + "/" + constraint.spec.replace("/", "\\/") + "/"]
    return [f"{name}: " + " | ".join(json.dumps(c) for c in json.loads(constraint.spec))]


def lark(rules: list[str], *, think: str | None, token_ids: Mapping[str, int]) -> str:
    """The whole grammar: `think` None (no thinking section), "open" (the model opens it) or "inside"."""
    if think is None:
        return "\n".join(["start: body", *rules])
    opening = _literal(THINK_OPEN, token_ids) + " " if think == "open" else ""
    return "\n".join([f"start: {opening}THOUGHT {_literal(THINK_CLOSE, token_ids)} GAP body",
                      f"THOUGHT: {_without(THINK_CLOSE)}", "GAP: /\\n{0,2}/", *rules])
