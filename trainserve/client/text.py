"""Server text shown as text: no Rich markup, no emoji codes, no terminal control sequences.

Anything the service returns (dataset columns, job fields, event messages, model output, error messages) may hold
`[bold]`-like tags or escape codes written by a tenant or a model; printed raw, Rich would interpret the tags (a
column named `[/bold]` raises MarkupError) and the terminal would obey the escapes.
"""

from __future__ import annotations

import unicodedata

KEEP = {"\n", "\t"}


def visible(text: object) -> str:
    """`text` with every control character (C0 but newline and tab, DEL, C1) written as a visible escape."""
    return "".join(ch if ch in KEEP or unicodedata.category(ch) != "Cc" else ascii(ch)[1:-1] for ch in str(text))


def plain(text: object) -> str:
    """`text` for a Rich markup string: control characters made visible and markup escaped."""
    from rich.markup import escape  # rich is imported when a client command runs, not when a worker starts

    return escape(visible(text))
