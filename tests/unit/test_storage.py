"""The artifact store on a shared folder and on a real S3 server (moto): two hosts, one store."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.settings import Settings
from core.storage import ArtifactStore, open_storage

MARKER = "manifest.json"


@pytest.fixture(params=["folder", "s3"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A storage URL every simulated host shares: a folder (a shared mount) or an S3 bucket."""
    if request.param == "folder":
        return str(tmp_path / "shared")
    return str(request.getfixturevalue("s3_url"))


def host(url: str, home: Path) -> ArtifactStore:
    """The store as a host with its own home folder sees it."""
    return open_storage(Settings(home=home, storage_url=url))


def _folder(root: Path, version: str) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "weights.bin").write_bytes(version.encode() * 1000)
    (root / "sub" / "tokenizer.json").write_text(f'{{"version": "{version}"}}')
    (root / MARKER).write_text(f'{{"version": "{version}"}}')
    return root


def _dies_at_the_marker(store: ArtifactStore) -> None:
    """Make the store's uploads fail at a folder's marker, as a host dying mid-upload would."""
    def put_or_die(local: Path, key: str) -> None:
        if key.endswith("/" + MARKER):
            raise ConnectionResetError("host died before uploading the marker")
        ArtifactStore._put(store, local, key)

    store._put = put_or_die  # type: ignore[method-assign]


def test_a_file_stored_by_one_host_is_downloaded_once_by_another(url, tmp_path):
    a, b = host(url, tmp_path / "a"), host(url, tmp_path / "b")
    spool = tmp_path / "a" / "upload.part"
    spool.parent.mkdir(parents=True)
    spool.write_bytes(b"sentence\tlabel\nfine\t1\n")
    a.move_in(spool, "datasets/ds_1.tsv")
    assert not spool.exists() and a.exists("datasets/ds_1.tsv")

    copy = b.fetch_file("datasets/ds_1.tsv")
    assert copy.read_bytes() == b"sentence\tlabel\nfine\t1\n"
    assert copy == tmp_path / "b" / "cache" / "datasets" / "ds_1.tsv"
    a.delete("datasets/ds_1.tsv")
    assert not a.exists("datasets/ds_1.tsv")
    assert b.fetch_file("datasets/ds_1.tsv") == copy  # served from b's cache: no second download
    with pytest.raises(FileNotFoundError):
        host(url, tmp_path / "c").fetch_file("datasets/ds_1.tsv")


def test_a_folder_is_complete_only_once_its_marker_is_stored_last(url, tmp_path):
    a, b = host(url, tmp_path / "a"), host(url, tmp_path / "b")
    src = _folder(tmp_path / "a" / "jobs" / "j" / "model", "v1")
    _dies_at_the_marker(a)
    with pytest.raises(ConnectionResetError):
        a.upload_dir(src, "jobs/j/model", marker=MARKER)
    # Everything but the marker was stored first; without it the folder is not a model yet.
    assert [name for name, _ in a.files("jobs/j/model")] == ["sub/tokenizer.json", "weights.bin"]
    assert b.fetch_dir("jobs/j/model", marker=MARKER) is None
    assert not (tmp_path / "b" / "cache" / "jobs" / "j" / "model").exists()

    del a._put  # the host is back
    a.upload_dir(src, "jobs/j/model", marker=MARKER)
    assert a.files("jobs/j/model") == [(MARKER, 17), ("sub/tokenizer.json", 17), ("weights.bin", 2000)]
    copy = b.fetch_dir("jobs/j/model", marker=MARKER)
    assert copy == tmp_path / "b" / "cache" / "jobs" / "j" / "model"
    assert (copy / "weights.bin").read_bytes() == b"v1" * 1000 and (copy / "sub" / "tokenizer.json").is_file()
    assert [p.name for p in copy.parent.iterdir()] == ["model"]  # no temporary folder left beside it
    with a.open("jobs/j/model/weights.bin") as stream:
        assert stream.read(4) == b"v1v1"


def test_a_folder_being_replaced_is_never_taken_for_complete(url, tmp_path):
    a = host(url, tmp_path / "a")
    a.upload_dir(_folder(tmp_path / "v1", "v1"), "jobs/j/checkpoints/checkpoint-5", marker=MARKER)
    _dies_at_the_marker(a)
    with pytest.raises(ConnectionResetError):  # a second attempt rewrites the same step and dies
        a.upload_dir(_folder(tmp_path / "v2", "v2"), "jobs/j/checkpoints/checkpoint-5", marker=MARKER)
    # Its old marker was withdrawn first, so nobody can read a mix of v1 and v2 as one checkpoint.
    assert host(url, tmp_path / "b").fetch_dir("jobs/j/checkpoints/checkpoint-5", marker=MARKER) is None
    assert a.children("jobs/j/checkpoints") == ["checkpoint-5"]


@pytest.mark.parametrize("key", ["../outside", "/etc/passwd", "jobs/../../x", "", "a\\b"])
def test_keys_cannot_leave_the_root(tmp_path, key):
    store = host(str(tmp_path / "shared"), tmp_path / "home")
    with pytest.raises(ValueError, match="invalid storage key"):
        store.exists(key)


def test_the_default_store_is_the_home_folder_and_moves_nothing(tmp_path):
    store = host("", tmp_path / "home")
    assert store.is_home and store.url == str((tmp_path / "home").resolve())
    spool = tmp_path / "home" / "datasets" / "ds_1.part"
    spool.parent.mkdir(parents=True)
    spool.write_text("x")
    store.move_in(spool, "datasets/ds_1.tsv")
    assert store.fetch_file("datasets/ds_1.tsv") == tmp_path / "home" / "datasets" / "ds_1.tsv"
    model = _folder(tmp_path / "home" / "jobs" / "j" / "model", "v1")
    store.upload_dir(model, "jobs/j/model", marker=MARKER)  # already in place
    assert store.fetch_dir("jobs/j/model", marker=MARKER) == model
    assert not (tmp_path / "home" / "cache").exists()


def test_storage_urls(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert host("s3://bucket/some/prefix/", tmp_path).url == "s3://bucket/some/prefix"
    assert host(f"file://{tmp_path}/shared", tmp_path / "home").url == str(tmp_path / "shared")
    assert not host(str(tmp_path / "shared"), tmp_path / "home").is_home
    for bad in ("gs://bucket", "s3://"):
        with pytest.raises(ValueError, match="TRAINSERVE_STORAGE_URL"):
            host(bad, tmp_path)
