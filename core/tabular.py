"""Parsing of uploaded tabular datasets (CSV, TSV, JSONL) with the standard library only."""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import PayloadTooLarge, ValidationFailed

FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".txt": "text"}

Value = str | int | float | bool | None


@dataclass(frozen=True)
class Table:
    """A parsed dataset: ordered column names and one dict per row."""

    format: str
    columns: list[str]
    rows: list[dict[str, Value]]


def format_for(filename: str) -> str:
    """Return the dataset format for a file name, by extension."""
    suffix = Path(filename).suffix.lower()
    if suffix not in FORMATS:
        raise ValidationFailed(
            "file",
            f"unsupported file extension {suffix or '(none)'!r}; use one of .csv, .tsv, .jsonl, .txt",
        )
    return FORMATS[suffix]


def parse_table(data: bytes, fmt: str, *, max_rows: int | None = None) -> Table:
    """Parse raw bytes into a Table, raising ValidationFailed('file', ...) on any defect."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValidationFailed("file", f"file is not valid UTF-8 (byte {exc.start})") from exc
    if not text.strip():
        raise ValidationFailed("file", "file is empty")
    if fmt == "text":
        table = _parse_text(text, max_rows)
    elif fmt == "jsonl":
        table = _parse_jsonl(text, max_rows)
    else:
        table = _parse_delimited(text, fmt, max_rows)
    if not table.rows:
        raise ValidationFailed("file", "file has a header but no data rows")
    return table


def read_table(path: Path) -> Table:
    """Read and parse a stored dataset file; the format comes from its extension."""
    return parse_table(path.read_bytes(), format_for(path.name))


def _parse_delimited(text: str, fmt: str, max_rows: int | None) -> Table:
    delimiter = "\t" if fmt == "tsv" else ","
    # TSV files such as GLUE's are not quoted: a stray '"' inside a sentence must stay literal.
    if fmt == "tsv":
        reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, quoting=csv.QUOTE_NONE)
    else:
        reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    try:
        header = next(reader)
    except (StopIteration, csv.Error) as exc:
        raise ValidationFailed("file", f"cannot read the header row: {exc}") from exc
    columns = [name.strip() for name in header]
    _check_columns(columns)
    rows: list[dict[str, Value]] = []
    try:
        for line_no, record in enumerate(reader, start=2):
            if not record or all(not cell.strip() for cell in record):
                continue
            if len(record) != len(columns):
                raise ValidationFailed(
                    "file",
                    f"line {line_no}: expected {len(columns)} fields, found {len(record)}",
                )
            rows.append({name: cell.strip() for name, cell in zip(columns, record, strict=True)})
            if max_rows is not None and len(rows) > max_rows:
                raise PayloadTooLarge(f"more than {max_rows} rows", field="file")
    except csv.Error as exc:
        raise ValidationFailed("file", f"malformed {fmt.upper()}: {exc}") from exc
    return Table(format=fmt, columns=columns, rows=rows)


def _parse_text(text: str, max_rows: int | None) -> Table:
    """A plain-text corpus (for causal-LM training): one row per non-empty line, column `text`."""
    rows: list[dict[str, Value]] = [{"text": line} for line in text.splitlines() if line.strip()]
    if max_rows is not None and len(rows) > max_rows:
        raise PayloadTooLarge(f"more than {max_rows} lines", field="file")
    return Table(format="text", columns=["text"], rows=rows)


def _parse_jsonl(text: str, max_rows: int | None) -> Table:
    columns: list[str] = []
    seen: set[str] = set()
    rows: list[dict[str, Value]] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record: Any = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValidationFailed("file", f"line {line_no}: invalid JSON ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise ValidationFailed("file", f"line {line_no}: each line must be a JSON object")
        for key, value in record.items():
            if isinstance(value, (dict, list)):
                raise ValidationFailed("file", f"line {line_no}: field {key!r} must be a scalar")
            if key not in seen:
                seen.add(key)
                columns.append(key)
        rows.append(record)
        if max_rows is not None and len(rows) > max_rows:
            raise PayloadTooLarge(f"more than {max_rows} rows", field="file")
    _check_columns(columns)
    return Table(format="jsonl", columns=columns, rows=rows)


def _check_columns(columns: list[str]) -> None:
    if not columns or any(not name for name in columns):
        raise ValidationFailed("file", "every column needs a non-empty name in the header")
    if len(set(columns)) != len(columns):
        raise ValidationFailed("file", "duplicate column names in the header")


def label_values(table: Table, column: str) -> list[Value]:
    """Return the label column's values, with numeric strings turned into ints."""
    values: list[Value] = []
    for row in table.rows:
        value = row.get(column)
        if isinstance(value, str):
            stripped = value.strip()
            value = int(stripped) if _is_int(stripped) else stripped
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        values.append(value)
    return values


def _is_int(text: str) -> bool:
    return text.lstrip("-").isdigit() and text not in ("", "-")


def label_space(values: list[Value]) -> list[int | str]:
    """Sorted distinct labels (ints numerically, else as strings); the order defines label ids."""
    distinct = {v for v in values if v is not None and v != ""}
    if all(isinstance(v, int) for v in distinct):
        return sorted(int(v) for v in distinct)  # type: ignore[arg-type]
    return sorted(str(v) for v in distinct)


MAX_TRACKED_VALUES = 1000


def column_stats(table: Table) -> dict[str, dict[str, object]]:
    """Per column: empty-cell count and, when there are few distinct values, their counts.

    Stored with the dataset so job submission can check label columns without re-reading the file.
    """
    stats: dict[str, dict[str, object]] = {}
    for column in table.columns:
        values = label_values(table, column)
        counts = Counter(str(v) for v in values if v is not None and v != "")
        stats[column] = {
            "empty": len(values) - sum(counts.values()),
            "values": dict(counts) if len(counts) <= MAX_TRACKED_VALUES else None,
        }
    return stats
