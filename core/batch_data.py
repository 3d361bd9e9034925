"""Batch input files (/v1/files with purpose "batch"): OpenAI's JSON Lines of requests, checked line by line.

Each line is `{"custom_id": str, "method": "POST", "url": one of BATCH_URLS, "body": {...}}` with custom_ids unique
in the file; every defect is a ValidationFailed('file', 'line N: ...'). The bodies themselves are checked when the
requests run (as the routes they name check them). Stored as a dataset of format "batch", never training data.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from core.errors import ValidationFailed
from core.tabular import RowReader, TableSummary, Value, json_objects, short

BATCH_FORMAT = "batch"
BATCH_COLUMNS = ["custom_id", "method", "url", "body"]
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_CUSTOM_ID = 512


def check_request(record: dict[str, Any], seen: set[str]) -> str | None:
    """The defect of one batch line (None when it is valid); `seen` collects the custom_ids so far."""
    unknown = sorted(set(record) - set(BATCH_COLUMNS))
    if unknown:
        return f"unknown field {short(unknown[0])}; a line holds {', '.join(BATCH_COLUMNS)}"
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        return f"custom_id must be a string of 1-{MAX_CUSTOM_ID} characters"
    if custom_id in seen:
        return f"custom_id {short(custom_id)} is used by an earlier line; each must be unique"
    seen.add(custom_id)
    if record.get("method") != "POST":
        return f"method must be \"POST\", got {short(record.get('method'))}"
    if record.get("url") not in BATCH_URLS:
        return f"url must be one of {', '.join(BATCH_URLS)}, got {short(record.get('url'))}"
    if not isinstance(record.get("body"), dict):
        return "body must be a JSON object (the request's body)"
    return None


class BatchReader(RowReader):
    """The checked requests of a batch input file."""

    def __init__(self, stream: BinaryIO, *, max_rows: int | None = None) -> None:
        super().__init__(stream, BATCH_FORMAT, max_rows=max_rows)
        self.columns = list(BATCH_COLUMNS)

    def _rows(self, text: io.TextIOWrapper) -> Iterator[dict[str, Value]]:
        seen: set[str] = set()
        for line_no, record in json_objects(text):
            defect = check_request(record, seen)
            if defect is not None:
                raise ValidationFailed("file", f"line {line_no}: {defect}")
            yield record


def summarize_batch(path: Path, fmt: str, *, max_rows: int | None = None) -> TableSummary:
    """Validate a batch input file in one streaming pass (it must be JSON Lines)."""
    if fmt != "jsonl":
        raise ValidationFailed("file", "a batch file is JSON Lines (.jsonl): one request per line")
    with open(path, "rb") as stream:
        count = sum(1 for _ in BatchReader(stream, max_rows=max_rows))
    return TableSummary(format=BATCH_FORMAT, columns=list(BATCH_COLUMNS), rows=count, stats={})
