"""Parsing of uploaded tabular datasets (CSV, TSV, JSONL, TXT), streamed row by row with the standard library.

Memory is bounded by a small multiple of the largest row (plus the bounded column stats): files are read one
line (one CSV record) at a time, never whole. Every defect is a ValidationFailed('file', ...) and every
exceeded limit a PayloadTooLarge(field='file'); nothing else escapes for any input bytes.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from core.errors import PayloadTooLarge, ValidationFailed

FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".txt": "text"}

Value = str | int | float | bool | None

MAX_COLUMN_NAME = 200  # JobCreate.text_column/label_column are at most this long: longer names are unusable
MAX_TRACKED_VALUES = 1000  # distinct values a label candidate may have
MAX_LABEL_CHARS = 100  # a longer value is text, not a label
STATS_BUDGET = 256 * 1024  # characters (plus a per-value overhead) of all tracked values of a dataset together
_VALUE_OVERHEAD = 32
_INT_LABEL = re.compile(r"-?[0-9]{1,18}")  # ASCII digits only ('²'.isdigit() is True); fits in int64
_CHUNK = 64 * 1024


@dataclass(frozen=True)
class Table:
    """A parsed dataset: ordered column names and one dict per row."""

    format: str
    columns: list[str]
    rows: list[dict[str, Value]]


@dataclass(frozen=True)
class TableSummary:
    """What is kept of an upload: its shape and bounded per-column stats (see `column_stats`)."""

    format: str
    columns: list[str]
    rows: int
    stats: dict[str, dict[str, Any]]


def format_for(filename: str) -> str:
    """Return the dataset format for a file name, by extension."""
    suffix = Path(filename).suffix.lower()
    if suffix not in FORMATS:
        raise ValidationFailed(
            "file",
            f"unsupported file extension {short(suffix) if suffix else '(none)'}; use one of .csv, .tsv, .jsonl, .txt",
        )
    return FORMATS[suffix]


def short(value: object, limit: int = 60) -> str:
    """repr() of a value cut to about `limit` characters, for error messages of bounded size."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text) - limit} more characters)"


def name_list(names: list[str], limit: int = 10) -> str:
    """A comma-separated list of at most `limit` names, with a count of the rest."""
    shown = ", ".join(n if len(n) <= 60 else f"{n[:60]}..." for n in names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


class RowReader:
    """Rows of one dataset stream, one at a time; `columns` grows as JSONL rows name new keys."""

    def __init__(self, stream: BinaryIO, fmt: str, *, max_rows: int | None = None,
                 max_columns: int | None = None) -> None:
        self.stream, self.format = stream, fmt
        self.max_rows, self.max_columns = max_rows, max_columns
        self.columns: list[str] = []
        self._known: set[str] = set()

    def __iter__(self) -> Iterator[dict[str, Value]]:
        start = self.stream.tell()
        try:
            if _is_blank(self.stream):
                raise ValidationFailed("file", "file is empty")
            self.stream.seek(start)
            # newline="": the csv module sees '\r\n' inside quoted fields untranslated, as it requires.
            text = io.TextIOWrapper(self.stream, encoding="utf-8-sig",
                                    newline="" if self.format in ("csv", "tsv") else None)
            try:
                count = 0
                for row in self._rows(text):
                    count += 1
                    if self.max_rows is not None and count > self.max_rows:
                        unit = "lines" if self.format == "text" else "rows"
                        raise PayloadTooLarge(f"more than {self.max_rows} {unit}", field="file")
                    yield row
            finally:
                text.detach()  # the caller owns the stream
        except UnicodeDecodeError as exc:
            self.stream.seek(start)
            raise ValidationFailed("file", f"file is not valid UTF-8 (byte {_bad_utf8_offset(self.stream)})") from exc
        if count == 0:
            raise ValidationFailed("file", "file has a header but no data rows")

    def _rows(self, text: io.TextIOWrapper) -> Iterator[dict[str, Value]]:
        if self.format == "text":
            return self._text(text)
        if self.format == "jsonl":
            return self._jsonl(text)
        return self._delimited(text)

    def _add_column(self, name: str) -> None:
        if not name:
            raise ValidationFailed("file", "every column needs a non-empty name in the header")
        if len(name) > MAX_COLUMN_NAME:
            raise ValidationFailed("file", f"column name {short(name)} is longer than {MAX_COLUMN_NAME} characters")
        if name in self._known:
            raise ValidationFailed("file", f"duplicate column name {short(name)} in the header")
        if self.max_columns is not None and len(self.columns) >= self.max_columns:
            raise PayloadTooLarge(f"more than {self.max_columns} columns", field="file")
        self._known.add(name)
        self.columns.append(name)

    def _delimited(self, text: Iterable[str]) -> Iterator[dict[str, Value]]:
        # TSV files such as GLUE's are not quoted: a stray '"' inside a sentence must stay literal.
        if self.format == "tsv":
            reader = csv.reader(text, delimiter="\t", quoting=csv.QUOTE_NONE)
        else:
            reader = csv.reader(text, delimiter=",")
        try:
            header = next(reader)
        except (StopIteration, csv.Error) as exc:
            raise ValidationFailed("file", f"cannot read the header row: {exc}") from exc
        if self.max_columns is not None and len(header) > self.max_columns:
            raise PayloadTooLarge(f"the header has {len(header)} columns; the limit is {self.max_columns}",
                                  field="file")
        if not header:
            raise ValidationFailed("file", "every column needs a non-empty name in the header")
        for name in header:
            self._add_column(name.strip())
        columns = self.columns
        try:
            for line_no, record in enumerate(reader, start=2):
                if not record or all(not cell.strip() for cell in record):
                    continue
                if len(record) != len(columns):
                    raise ValidationFailed(
                        "file", f"line {line_no}: expected {len(columns)} fields, found {len(record)}")
                yield {name: cell.strip() for name, cell in zip(columns, record, strict=True)}
        except csv.Error as exc:
            raise ValidationFailed("file", f"malformed {self.format.upper()}: {exc}") from exc

    def _text(self, text: Iterable[str]) -> Iterator[dict[str, Value]]:
        """A plain-text corpus (for causal-LM training): one row per non-empty line, column `text`."""
        self._add_column("text")
        for physical in text:
            # splitlines() also breaks at \x0b, \x1c, \u2028...: the same rows as splitting the whole text.
            for line in physical.splitlines():
                if line.strip():
                    yield {"text": line}

    def _jsonl(self, text: Iterable[str]) -> Iterator[dict[str, Value]]:
        for line_no, record in json_objects(text):
            for key, value in record.items():
                if isinstance(value, (dict, list)):
                    raise ValidationFailed("file", f"line {line_no}: field {short(key)} must be a scalar")
                if key not in self._known:
                    self._add_column(key)
            yield record
        if not self.columns:
            raise ValidationFailed("file", "every column needs a non-empty name in the header")


def json_objects(text: Iterable[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of each non-blank JSON Lines line; a line that is not a JSON object is refused."""
    for line_no, line in enumerate(text, start=1):
        if not line.strip():
            continue
        try:
            record: Any = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValidationFailed("file", f"line {line_no}: invalid JSON ({exc.msg})") from exc
        except RecursionError as exc:
            raise ValidationFailed("file", f"line {line_no}: invalid JSON (nested too deeply)") from exc
        except ValueError as exc:  # an integer over sys.get_int_max_str_digits() digits
            raise ValidationFailed("file", f"line {line_no}: invalid JSON (a number has too many digits)") from exc
        if not isinstance(record, dict):
            raise ValidationFailed("file", f"line {line_no}: each line must be a JSON object")
        yield line_no, record


def _is_blank(stream: BinaryIO) -> bool:
    """True when the stream holds only whitespace (read until the first other character)."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    while chunk := stream.read(_CHUNK):
        if decoder.decode(chunk).strip():
            return False
    return not decoder.decode(b"", final=True).strip()


def _bad_utf8_offset(stream: BinaryIO) -> int:
    """Byte offset of the first invalid UTF-8 sequence, found by a second streaming pass."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    while True:
        chunk = stream.read(_CHUNK)
        try:
            decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError as exc:
            pending = len(exc.object) - len(chunk)  # bytes of an unfinished sequence carried from the last chunk
            return offset - pending + exc.start
        if not chunk:
            return offset
        offset += len(chunk)


def parse_table(data: bytes, fmt: str, *, max_rows: int | None = None, max_columns: int | None = None) -> Table:
    """Parse raw bytes into a Table, raising ValidationFailed('file', ...) on any defect."""
    reader = RowReader(io.BytesIO(data), fmt, max_rows=max_rows, max_columns=max_columns)
    rows = list(reader)
    return Table(format=fmt, columns=reader.columns, rows=rows)


def read_table(path: Path) -> Table:
    """Read and parse a stored dataset file; the format comes from its extension."""
    with open(path, "rb") as stream:
        reader = RowReader(stream, format_for(path.name))
        rows = list(reader)
    return Table(format=reader.format, columns=reader.columns, rows=rows)


def summarize_file(path: Path, fmt: str, *, max_rows: int | None = None,
                   max_columns: int | None = None) -> TableSummary:
    """Stream a file once: validate every row, count them and build bounded column stats; rows are not kept."""
    with open(path, "rb") as stream:
        reader = RowReader(stream, fmt, max_rows=max_rows, max_columns=max_columns)
        stats = _StatsBuilder()
        for row in reader:
            stats.add(row, reader.columns)
    return TableSummary(format=fmt, columns=reader.columns, rows=stats.rows, stats=stats.result(reader.columns))


def to_label(value: Value) -> Value:
    """A cell as a label: integer-looking values (ASCII digits, at most 18) become ints, strings are stripped."""
    if isinstance(value, str):
        stripped = value.strip()
        return int(stripped) if _INT_LABEL.fullmatch(stripped) else stripped
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e18:
        return int(value)
    if isinstance(value, int) and abs(value) >= 10**18:
        return str(value)  # the same label a CSV cell with these digits gives
    return value


def label_values(table: Table, column: str) -> list[Value]:
    """Return the label column's values, with numeric strings turned into ints."""
    return [to_label(row.get(column)) for row in table.rows]


def label_space(values: list[Value]) -> list[int | str]:
    """Sorted distinct labels (ints numerically, else as strings); the order defines label ids."""
    distinct = {v for v in values if v is not None and v != ""}
    if all(isinstance(v, int) for v in distinct):
        return sorted(int(v) for v in distinct)  # type: ignore[arg-type]
    return sorted(str(v) for v in distinct)


def column_stats(table: Table) -> dict[str, dict[str, object]]:
    """Per column: empty-cell count and, for a label candidate, the count of each distinct value.

    Stored with the dataset so job submission can check label columns without re-reading the file.
    `values` is None when the column has over MAX_TRACKED_VALUES distinct values, a value longer than
    MAX_LABEL_CHARS, or when all columns' values together would pass STATS_BUDGET (the largest is dropped).
    """
    stats = _StatsBuilder()
    for row in table.rows:
        stats.add(row, table.columns)
    return stats.result(table.columns)  # type: ignore[return-value]


def bounded_stats(stats: dict[str, Any], columns: list[str], max_columns: int) -> dict[str, dict[str, Any]]:
    """Stats as a client may read them, bounded even for rows stored before stats were bounded."""
    result: dict[str, dict[str, Any]] = {}
    for column in columns[:max_columns]:
        entry = stats.get(column)
        if not isinstance(entry, dict):
            continue
        values = entry.get("values")
        if not isinstance(values, dict) or len(values) > MAX_TRACKED_VALUES or any(
                len(key) > MAX_LABEL_CHARS for key in values):
            values = None
        result[column] = {"empty": int(entry.get("empty") or 0), "values": values}
    return result


class _StatsBuilder:
    """Empty counts and bounded distinct-value counts, fed one row at a time."""

    def __init__(self) -> None:
        self.rows = 0
        self.empty: dict[str, int] = {}
        self.values: dict[str, Counter[str] | None] = {}
        self.cost: dict[str, int] = {}
        self.total_cost = 0

    def add(self, row: dict[str, Value], columns: list[str]) -> None:
        for column in columns:
            if column not in self.empty:  # a JSONL key first seen now was missing from the rows before
                self.empty[column], self.values[column], self.cost[column] = self.rows, Counter(), 0
            raw, counts = row.get(column), self.values[column]
            if counts is None:  # no longer a label candidate: only emptiness is counted (cheaply: most cells)
                if raw is None or raw == "" or isinstance(raw, str) and not raw.strip():
                    self.empty[column] += 1
                continue
            value = to_label(raw)
            if value is None or value == "":
                self.empty[column] += 1
                continue
            key = str(value)
            if key in counts:
                counts[key] += 1
            elif len(key) > MAX_LABEL_CHARS or len(counts) >= MAX_TRACKED_VALUES:
                self._drop(column)
            else:
                counts[key] = 1
                self.cost[column] += len(key) + _VALUE_OVERHEAD
                self.total_cost += len(key) + _VALUE_OVERHEAD
                if self.total_cost > STATS_BUDGET:
                    self._drop(max(self.cost, key=self.cost.__getitem__))
        self.rows += 1

    def _drop(self, column: str) -> None:
        self.values[column] = None
        self.total_cost -= self.cost[column]
        self.cost[column] = 0

    def result(self, columns: list[str]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for column in columns:
            counts = self.values.get(column)
            out[column] = {"empty": self.empty.get(column, self.rows),
                           "values": dict(counts) if counts is not None else None}
        return out
