"""Server-sent events framing, for every stream the API sends (generation, completions, a job's live feed)."""

from __future__ import annotations

import json
from typing import Any

# A job's feed sends compact JSON; the generation streams keep json.dumps' default spacing, as they always have.
COMPACT = (",", ":")


def sse_message(data: Any, *, event: str | None = None, id: str | None = None,
                separators: tuple[str, str] | None = None) -> str:
    """One SSE message: `id:` and `event:` lines when given, then `data:` (JSON-encoded unless already a string)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=separators)
    head = (f"id: {id}\n" if id is not None else "") + (f"event: {event}\n" if event else "")
    return f"{head}data: {payload}\n\n"


def sse_comment(text: str) -> str:
    """A comment line (clients ignore it): a keep-alive that also finds a client that has gone."""
    return f": {text}\n\n"


def sse_retry(milliseconds: int) -> str:
    """How long an EventSource client waits before it reconnects (with Last-Event-ID)."""
    return f"retry: {milliseconds}\n\n"
