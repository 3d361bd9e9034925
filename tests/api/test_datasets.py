"""POST/GET/DELETE /datasets against a real PostgreSQL."""

from __future__ import annotations

import hashlib
import json

from tests.factories import sentiment_rows, tsv_bytes, upload


def test_upload_tsv_reports_rows_columns_and_hash(client, settings):
    content = tsv_bytes(sentiment_rows())
    response = upload(client, content, name="sentiment")
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["name"] == "sentiment"
    assert body["rows"] == 12
    assert body["columns"] == ["sentence", "label"]
    assert body["sha256"] == hashlib.sha256(content).hexdigest()
    assert set(body) >= {"id", "name", "rows", "columns", "sha256", "created_at"}
    assert (settings.home / "datasets" / f"{body['id']}.tsv").read_bytes() == content
    again = upload(client, content)
    assert again.json()["sha256"] == body["sha256"] and again.json()["id"] != body["id"]


def test_upload_csv_and_jsonl(client):
    csv_content = b'text,label\n"hello, world",pos\nbad day,neg\n'
    response = upload(client, csv_content, filename="d.csv")
    assert response.status_code == 201, response.text
    assert response.json()["rows"] == 2
    lines = [json.dumps({"text": "good", "label": "pos"}), json.dumps({"text": "bad", "label": "neg"})]
    response = upload(client, "\n".join(lines).encode(), filename="d.jsonl")
    assert response.status_code == 201 and response.json()["columns"] == ["text", "label"]


def test_get_list_paginate_delete(client):
    ids = [upload(client, tsv_bytes(sentiment_rows()), name=f"d{i}").json()["id"] for i in range(3)]
    assert client.get(f"/datasets/{ids[0]}").json()["name"] == "d0"
    first = client.get("/datasets", params={"limit": 2}).json()
    assert [d["id"] for d in first["data"]] == [ids[2], ids[1]] and first["has_more"]
    second = client.get("/datasets", params={"limit": 2, "cursor": first["next_cursor"]}).json()
    assert [d["id"] for d in second["data"]] == [ids[0]] and not second["has_more"]
    assert client.delete(f"/datasets/{ids[0]}").status_code == 204
    assert client.get(f"/datasets/{ids[0]}").status_code == 404


def _error(response, status, field):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["field"] == field, error
    assert error["message"]
    return error


def test_bad_uploads_are_refused_and_nothing_is_stored(client, settings):
    _error(upload(client, b"", filename="x.tsv"), 422, "file")
    _error(upload(client, b"sentence\tlabel\n", filename="x.tsv"), 422, "file")
    _error(upload(client, b"a\tb\n1\t2\t3\n", filename="x.tsv"), 422, "file")
    _error(upload(client, b"{not json}\n", filename="x.jsonl"), 422, "file")
    _error(upload(client, b"[1, 2]\n", filename="x.jsonl"), 422, "file")
    _error(upload(client, b"\xff\xfe\x00bad", filename="x.csv"), 422, "file")
    _error(upload(client, b"a,b\n1,2\n", filename="x.parquet"), 422, "file")
    _error(upload(client, b"a,a\n1,2\n", filename="x.csv"), 422, "file")
    _error(upload(client, tsv_bytes(sentiment_rows()), name="../../etc/passwd"), 422, "name")
    _error(client.post("/datasets", data={"name": "x"}), 422, "file")
    assert client.get("/datasets").json()["data"] == []
    assert not any((settings.home / "datasets").glob("*")) if (settings.home / "datasets").exists() else True


def test_size_and_row_limits_give_413(client, settings):
    settings.max_upload_bytes = 50
    _error(upload(client, tsv_bytes(sentiment_rows())), 413, "file")
    settings.max_upload_bytes = 10**6
    settings.max_dataset_rows = 5
    _error(upload(client, tsv_bytes(sentiment_rows())), 413, "file")


def test_client_path_in_filename_is_ignored(client, settings):
    response = upload(client, tsv_bytes(sentiment_rows()), filename="../../evil.tsv")
    assert response.status_code == 201
    assert response.json()["filename"] == "evil.tsv"
    assert not (settings.home.parent / "evil.tsv").exists()


def test_unknown_dataset_is_404_envelope(client):
    error = _error(client.get("/datasets/ds_nope"), 404, None)
    assert error["code"] == "not_found"
    assert client.delete("/datasets/ds_nope").status_code == 404


def test_chat_upload_is_validated_per_line_and_previewed(client):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "weight": 1}]}
    response = upload(client, (json.dumps(good) + "\n").encode() * 2, filename="chat.jsonl")
    assert response.status_code == 201, response.text
    body = response.json()
    assert (body["format"], body["rows"], body["columns"]) == ("chat", 2, ["messages"])
    preview = client.get(f"/datasets/{body['id']}/preview").json()
    assert preview["rows"] == [good, good]
    bad = {"messages": [{"role": "user", "content": "Hi"}]}
    error = _error(upload(client, (json.dumps(good) + "\n" + json.dumps(bad)).encode(), filename="c.jsonl"),
                   422, "file")
    assert error["message"].startswith("line 2: ") and "assistant" in error["message"]
