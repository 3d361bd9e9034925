"""Template references in graders and eval prompts: `{{item.answer}}`, `{{sample.output_text}}`,
`{{sample.output_json.field}}` (a dotted path into the namespace; a list index is a number)."""

from __future__ import annotations

import json
import re
from typing import Any

REFERENCE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_-]+)*)\s*\}\}")
NAMESPACES = ("item", "sample")


class UnknownVariable(ValueError):
    """A template names a variable its namespaces do not hold."""


def lookup(path: str, namespaces: dict[str, Any]) -> Any:
    """The value at a dotted path (`item.answer`, `sample.output_json.items.0`), or UnknownVariable."""
    head, *rest = path.split(".")
    if head not in namespaces:
        raise UnknownVariable(f"{{{{{path}}}}}: the namespace is one of {', '.join(NAMESPACES)}")
    value = namespaces[head]
    for key in rest:
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            raise UnknownVariable(f"{{{{{path}}}}}: {key!r} is not there")
    return value


def text_of(value: Any) -> str:
    """A value as a template writes it: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def render(template: str, namespaces: dict[str, Any]) -> str:
    """`template` with every reference replaced by its value's text; UnknownVariable names the first missing."""
    return REFERENCE.sub(lambda match: text_of(lookup(match.group(1), namespaces)), template)


def references(template: str) -> list[str]:
    """The dotted paths a template refers to."""
    return REFERENCE.findall(template)


def sample_namespace(output_text: str, **extra: Any) -> dict[str, Any]:
    """OpenAI's `sample` namespace: output_text, and output_json when the text is a JSON value."""
    sample: dict[str, Any] = {"output_text": output_text, **extra}
    try:
        sample["output_json"] = json.loads(output_text)
    except ValueError:
        pass
    return sample
