"""Property tests of the table parser: any input gives a table or the service's own errors, in bounded memory."""

from __future__ import annotations

import csv
import io
import json
import tempfile
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import PayloadTooLarge, ValidationFailed
from core.tabular import (
    MAX_LABEL_CHARS,
    MAX_TRACKED_VALUES,
    STATS_BUDGET,
    column_stats,
    label_space,
    parse_table,
    summarize_file,
    to_label,
)

FORMATS = ["csv", "tsv", "jsonl", "text"]
OWN_ERRORS = (ValidationFailed, PayloadTooLarge)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

# Digits of other scripts, superscripts and fractions: str.isdigit()/isnumeric() say yes, int() may say no.
UNICODE_DIGITS = "²³¹⁰¼½٣٤۵߀०১௫๑໒༣၄႕០᠑᥆᧐᪀᭐᮰᱀᱐꘠꣐꤀꧐꩐꯰０𝟎𝟘"
cell_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30)
scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), cell_text,
                   st.text(alphabet=UNICODE_DIGITS + "-", min_size=1, max_size=5))
json_value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(cell_text, inner,
                                                                                               max_size=3),
                          max_leaves=8)


def _parse_or_own_error(data: bytes, fmt: str, **limits: int) -> None:
    try:
        table = parse_table(data, fmt, **limits)
    except OWN_ERRORS as exc:
        assert exc.field == "file"
        assert len(exc.message) < 500, exc.message  # messages stay small whatever the input
        return
    stats = column_stats(table)
    assert set(stats) == set(table.columns)
    label_space([to_label(key) for entry in stats.values() for key in (entry["values"] or {})])


@FAST
@given(data=st.binary(max_size=3000), fmt=st.sampled_from(FORMATS))
def test_arbitrary_bytes_give_a_table_or_a_service_error(data, fmt):
    _parse_or_own_error(data, fmt)


@FAST
@given(rows=st.lists(st.dictionaries(cell_text, json_value, max_size=5), min_size=1, max_size=8),
       junk=st.sampled_from(["", "\n", "{", "[" * 5000, "1" * 5000, '{"a": ' + "[" * 100_000 + "\n"]))
def test_generated_jsonl_with_nesting_big_numbers_and_unicode_digits(rows, junk):
    data = ("\n".join(json.dumps(row) for row in rows) + "\n" + junk).encode()
    _parse_or_own_error(data, "jsonl")
    _parse_or_own_error(data, "jsonl", max_rows=2, max_columns=2)


@FAST
@given(header=st.lists(cell_text, min_size=1, max_size=6),
       body=st.lists(st.lists(st.one_of(cell_text, st.text(alphabet=UNICODE_DIGITS + "-+ ", max_size=6)),
                              min_size=1, max_size=6), max_size=8),
       fmt=st.sampled_from(["csv", "tsv"]))
def test_generated_delimited_files(header, body, fmt):
    out = io.StringIO()
    for record in [header, *body]:
        if fmt == "csv":
            csv.writer(out).writerow(record)
        else:  # GLUE-style TSV: raw cells, whatever they hold
            out.write("\t".join(record) + "\n")
    data = out.getvalue().encode()
    _parse_or_own_error(data, fmt)
    _parse_or_own_error(data, fmt, max_rows=3, max_columns=3)


def test_well_formed_delimited_rows_round_trip():
    header, rows = ["text", "label"], [["a, \"quoted\" cell", "²"], ["x", "-7"], ["y", "٣"]]
    out = io.StringIO()
    csv.writer(out).writerows([header, *rows])
    table = parse_table(out.getvalue().encode(), "csv")
    assert [[r["text"], r["label"]] for r in table.rows] == rows
    assert column_stats(table)["label"]["values"] == {"²": 1, "-7": 1, "٣": 1}


@pytest.mark.parametrize("cell", list("²³¼٣०") + ["--5", "1²", "+1", "9" * 5000, "-", ""])
def test_unicode_digits_and_odd_numbers_stay_strings(cell):
    label = to_label(cell)
    assert label == cell.strip() and isinstance(label, str)


def test_integer_labels_are_ascii_and_bounded():
    assert to_label(" 12 ") == 12 and to_label("-3") == -3 and to_label(True) == 1 and to_label(2.0) == 2
    assert to_label("9" * 19) == "9" * 19 and to_label(10**30) == str(10**30)
    assert to_label(1e300) == 1e300  # a float too large to be an int64 label stays a float


def test_column_limit_and_long_names():
    wide = (",".join(f"c{i}" for i in range(300)) + "\n" + ",".join("1" * 300) + "\n").encode()
    with pytest.raises(PayloadTooLarge) as info:
        parse_table(wide, "csv", max_columns=256)
    assert info.value.field == "file" and "256" in info.value.message
    assert len(parse_table(wide, "csv", max_columns=300).columns) == 300
    many_keys = (json.dumps({f"k{i}": i for i in range(300)}) + "\n").encode()
    with pytest.raises(PayloadTooLarge):
        parse_table(many_keys, "jsonl", max_columns=256)
    with pytest.raises(ValidationFailed) as long_name:
        parse_table(("x" * 100_000 + "\n1\n").encode(), "csv")
    assert len(long_name.value.message) < 300


def test_stats_are_bounded_in_size():
    text = [f"sentence number {i} " + "w" * (i % 150) for i in range(5000)]
    rows = [{"text": t, "label": i % 3, "id": str(i), **{f"c{j}": f"{i % 900}-{j}" for j in range(20)}}
            for i, t in enumerate(text)]
    table = parse_table("\n".join(json.dumps(r) for r in rows).encode(), "jsonl")
    stats = column_stats(table)
    assert stats["label"] == {"empty": 0, "values": {"0": 1667, "1": 1667, "2": 1666}}
    assert stats["text"]["values"] is None and stats["id"]["values"] is None
    size = len(json.dumps(stats))
    assert size < 2 * STATS_BUDGET, size
    for entry in stats.values():
        values = entry["values"] or {}
        assert len(values) <= MAX_TRACKED_VALUES and all(len(k) <= MAX_LABEL_CHARS for k in values)


def _peak_bytes(path: Path, fmt: str) -> int:
    tracemalloc.start()
    try:
        summarize_file(path, fmt)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("fmt", FORMATS)
def test_memory_is_bounded_by_the_row_not_the_file(fmt, tmp_path):
    """Peak memory of parsing a many-row file is a small multiple of its largest row, not of the file."""
    def write(rows: int, path: Path) -> tuple[int, int]:
        lines = []
        for i in range(rows):
            text = f"row {i} " + "lorem ipsum " * 12 + str(i)
            lines.append({"jsonl": json.dumps({"text": text, "label": i % 2}),
                          "csv": f"{text},{i % 2}", "tsv": f"{text}\t{i % 2}", "text": text}[fmt])
        header = {"csv": "text,label\n", "tsv": "text\tlabel\n"}.get(fmt, "")
        data = (header + "\n".join(lines) + "\n").encode()
        path.write_bytes(data)
        return len(data), max(len(line.encode()) for line in lines)

    small_size, row = write(5_000, tmp_path / "small")
    big_size, _ = write(40_000, tmp_path / "big")
    small_peak, big_peak = _peak_bytes(tmp_path / "small", fmt), _peak_bytes(tmp_path / "big", fmt)
    assert big_size > 6_000_000
    # Fixed buffers (read chunks, bounded stats) plus a few rows; 8x the data must not move it.
    assert big_peak < 400 * 1024 + 50 * row, (big_peak, row)
    assert big_peak < small_peak * 1.5 + 64 * 1024, (small_peak, big_peak)


def test_memory_of_one_huge_row_is_a_small_multiple_of_it(tmp_path):
    path = tmp_path / "huge.jsonl"
    huge = json.dumps({"text": "y" * 2_000_000, "label": 1})
    path.write_text("\n".join([json.dumps({"text": "a", "label": 0}), huge] * 3) + "\n")
    peak = _peak_bytes(path, "jsonl")
    assert peak < 6 * len(huge), (peak, len(huge))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=2000), fmt=st.sampled_from(FORMATS))
def test_file_summaries_raise_only_service_errors(data, fmt):
    with tempfile.NamedTemporaryFile() as handle:
        handle.write(data)
        handle.flush()
        try:
            summary = summarize_file(Path(handle.name), fmt, max_rows=50, max_columns=8)
        except OWN_ERRORS as exc:
            assert exc.field == "file"
            return
    assert summary.rows >= 1 and len(summary.columns) <= 8 and set(summary.stats) == set(summary.columns)
