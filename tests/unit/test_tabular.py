"""Stdlib parsing of uploads."""

import pytest

from core.errors import PayloadTooLarge, ValidationFailed
from core.tabular import column_stats, format_for, label_space, label_values, parse_table


def test_tsv_keeps_quotes_literal_like_glue():
    table = parse_table(b'sentence\tlabel\nthe "best" film \t1\n', "tsv")
    assert table.rows == [{"sentence": 'the "best" film', "label": "1"}]


def test_csv_quoted_commas_and_bom():
    table = parse_table('\ufefftext,label\n"a, b",x\n'.encode(), "csv")
    assert table.columns == ["text", "label"] and table.rows[0]["text"] == "a, b"


def test_jsonl_union_of_keys_and_types():
    table = parse_table(b'{"t": "a", "y": 1}\n\n{"t": "b", "y": 0, "extra": true}\n', "jsonl")
    assert table.columns == ["t", "y", "extra"]
    assert label_values(table, "y") == [1, 0]


@pytest.mark.parametrize(("data", "fmt"), [(b"", "csv"), (b"a,b\n", "csv"), (b"a,b\n1\n", "csv"),
                                           (b"[1]\n", "jsonl"), (b'{"a": {"b": 1}}\n', "jsonl"),
                                           (b",b\n1,2\n", "csv")])
def test_defects_name_the_file_field(data, fmt):
    with pytest.raises(ValidationFailed) as info:
        parse_table(data, fmt)
    assert info.value.field == "file"


def test_row_limit():
    with pytest.raises(PayloadTooLarge):
        parse_table(b"a\n1\n2\n3\n", "csv", max_rows=2)


def test_format_by_extension():
    assert format_for("X.TSV") == "tsv" and format_for("a.ndjson") == "jsonl"
    with pytest.raises(ValidationFailed):
        format_for("data.xlsx")


def test_label_space_and_stats():
    assert label_space([1, 0, 1, 2]) == [0, 1, 2]
    assert label_space(["pos", "neg", 1]) == ["1", "neg", "pos"]
    table = parse_table(b"t\ty\na\t1\nb\t\nc\t0\n", "tsv")
    stats = column_stats(table)
    assert stats["y"] == {"empty": 1, "values": {"1": 1, "0": 1}}
