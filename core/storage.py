"""Artifact storage: datasets, checkpoints and models under one root that every host can reach, via fsspec.

Objects are named by keys, the same relative paths a row records ("datasets/ds_x.tsv", "jobs/<id>/model").
TRAINSERVE_STORAGE_URL picks the root: empty means this host's home (one host; keys are the files
themselves, nothing is copied), a folder path (e.g. a shared mount), or s3://bucket/prefix through s3fs,
whose credentials and endpoint come from the standard AWS_* variables (AWS_ENDPOINT_URL for MinIO).
As in MLflow's artifact repositories and Ray Train's storage, work happens in local folders: a folder is
uploaded file by file with its completion marker last (a reader that sees the marker sees all of it),
and what a host downloads is cached under <home>/cache/<key>.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path, PurePosixPath
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from core.errors import StorageUnavailable
from core.settings import Settings

CACHE_DIRNAME = "cache"


class ArtifactStore:
    """Objects under one fsspec root, addressed by relative keys; local copies live under <home>."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, home: Path) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.home = Path(home).resolve()
        self.is_local = isinstance(fs, LocalFileSystem)
        # The default: objects are this host's own files, so uploads and downloads are no-ops.
        self.is_home = self.is_local and Path(self.root).resolve() == self.home

    @property
    def url(self) -> str:
        """Where objects live, for messages and logs."""
        return self.root if self.is_local else f"{self.fs.protocol[0]}://{self.root}"

    def work_path(self, key: str) -> Path:
        """The folder or file under this host's home where a worker writes the object before uploading it."""
        return self.home / _checked(key)

    def cache_path(self, key: str) -> Path:
        """Where this host keeps a downloaded copy of the object."""
        return self.work_path(key) if self.is_home else self.home / CACHE_DIRNAME / _checked(key)

    # --- reading -------------------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Whether an object (or a folder of objects) is stored under `key`."""
        return bool(self.fs.exists(self._remote(key)))

    def children(self, key: str) -> list[str]:
        """Names of the entries directly under the folder `key` (empty when there is none)."""
        try:
            entries = self.fs.ls(self._remote(key), detail=False)
        except FileNotFoundError:
            return []
        return sorted(PurePosixPath(str(e).rstrip("/")).name for e in entries)

    def files(self, key: str) -> list[tuple[str, int]]:
        """Every file under the folder `key`, as (path relative to it, size in bytes), sorted."""
        base = self._remote(key)
        found = self.fs.find(base, detail=True)
        return sorted((str(PurePosixPath(name).relative_to(base)), int(info.get("size") or 0))
                      for name, info in found.items() if info.get("type") != "directory")

    def open(self, key: str) -> IO[bytes]:
        """A binary stream of one object (read in chunks: memory stays bounded)."""
        stream: IO[bytes] = self.fs.open(self._remote(key), "rb")
        return stream

    def fetch_file(self, key: str) -> Path:
        """A local copy of one object, downloaded once per host; FileNotFoundError when it is not stored."""
        target = self.cache_path(key)
        if target.is_file():
            return target
        if self.is_home:
            raise FileNotFoundError(f"{key} is not in the artifact store ({self.url})")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{_token()}.part")
        try:
            self._get(key, tmp)
            os.replace(tmp, target)  # concurrent fetches each write their own part file; the last rename wins
        finally:
            tmp.unlink(missing_ok=True)
        return target

    def fetch_dir(self, key: str, *, marker: str) -> Path | None:
        """A complete local copy of the folder `key` (cached per host), or None while it has no `marker`."""
        target = self.cache_path(key)
        if (target / marker).is_file():
            return target
        if self.is_home:
            return None
        return target if self.download_dir(key, target, marker=marker) else None

    def download_dir(self, key: str, dest: Path, *, marker: str) -> bool:
        """Copy the folder `key` to `dest` if its `marker` is stored; dest appears whole or not at all."""
        dest = Path(dest)
        if self.is_home and dest.resolve() == self.work_path(key).resolve():
            return (dest / marker).is_file()
        if not self.fs.exists(self._remote(f"{key}/{marker}")):
            return False
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".tmp-{dest.name}-{_token()}")
        try:
            names = [name for name, _ in self.files(key)]
            if marker not in names:  # withdrawn since: the folder is being replaced
                return False
            for name in names:
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            # Concurrent transfers on S3; the marker came with the listing, so the copy is of a complete folder.
            self.fs.get([self._remote(f"{key}/{n}") for n in names], [str(tmp / n) for n in names])
            if dest.exists():
                shutil.rmtree(dest)
            try:
                os.replace(tmp, dest)
            except OSError:  # another thread or process finished the same download first
                if not (dest / marker).is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return True

    # --- writing -------------------------------------------------------------------------------------------

    def move_in(self, src: Path, key: str) -> None:
        """Store a local file under `key` and remove the local file; readers never see part of it."""
        if self.is_home:
            target = self.work_path(key)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(src, target)  # a rename when src is under home, as the API's spool file is
            return
        try:
            self._put(Path(src), key)
        except Exception as exc:  # noqa: BLE001 - s3fs and botocore raise many kinds; the caller gets one
            raise StorageUnavailable(f"could not store {key} in {self.url}: {type(exc).__name__}: {exc}") from exc
        Path(src).unlink(missing_ok=True)

    def upload_dir(self, src: Path, key: str, *, marker: str) -> None:
        """Store the folder `src` under `key`: any old marker removed first, then the files, the marker last."""
        src = Path(src)
        if self.is_home and src.resolve() == self.work_path(key).resolve():
            return
        if not (src / marker).is_file():
            raise ValueError(f"{src} has no {marker}: only complete folders are uploaded")
        self.delete(f"{key}/{marker}")  # a reader must not take a half-replaced folder for a complete one
        body = sorted(p for p in src.rglob("*") if p.is_file() and p != src / marker)
        self._put_many(body, [f"{key}/{p.relative_to(src).as_posix()}" for p in body])
        self._put(src / marker, f"{key}/{marker}")

    def delete(self, key: str) -> None:
        """Remove an object or a whole folder of objects; nothing happens when it is absent."""
        remote = self._remote(key)
        try:
            if self.fs.exists(remote):
                self.fs.rm(remote, recursive=True)
        except FileNotFoundError:
            pass

    # --- plumbing ------------------------------------------------------------------------------------------

    def _remote(self, key: str) -> str:
        return f"{self.root}/{_checked(key)}"

    def _get(self, key: str, local: Path) -> None:
        try:
            self.fs.get_file(self._remote(key), str(local))
        except FileNotFoundError:
            raise FileNotFoundError(f"{key} is not in the artifact store ({self.url})") from None

    def _put_many(self, local: list[Path], keys: list[str]) -> None:
        if self.is_local:
            for path, key in zip(local, keys, strict=True):
                self._put(path, key)
        elif local:  # s3fs uploads a list concurrently (fsspec's batch size)
            self.fs.put([str(p) for p in local], [self._remote(k) for k in keys])

    def _put(self, local: Path, key: str) -> None:
        remote = self._remote(key)
        if not self.is_local:  # an S3 PUT (multipart for large files) is atomic: all of the object or none
            self.fs.put_file(str(local), remote)
            return
        self.fs.makedirs(str(PurePosixPath(remote).parent), exist_ok=True)
        tmp = f"{remote}.{_token()}.part"
        self.fs.put_file(str(local), tmp)
        self.fs.mv(tmp, remote)  # a rename within one folder


def _checked(key: str) -> str:
    """A key is a relative POSIX path without '..': a row can never name something outside the root."""
    path = PurePosixPath(key)
    if not key or path.is_absolute() or ".." in path.parts or "\\" in key:
        raise ValueError(f"invalid storage key {key!r}")
    return str(path)


def _token() -> str:
    return f"{os.getpid()}-{threading.get_ident()}"


def open_storage(settings: Settings) -> ArtifactStore:
    """The store TRAINSERVE_STORAGE_URL names: <home> when empty, a folder, or s3://bucket/prefix."""
    url = settings.storage_url.strip()
    if not url:
        return ArtifactStore(LocalFileSystem(), str(settings.home.resolve()), settings.home)
    protocol, scheme, rest = url.partition("://")
    if not scheme:  # a plain folder path
        return ArtifactStore(LocalFileSystem(), str(Path(url).expanduser().resolve()), settings.home)
    if protocol == "file":
        return ArtifactStore(LocalFileSystem(), str(Path(rest).resolve()), settings.home)
    if protocol in ("s3", "s3a"):
        options: dict[str, Any] = {
            # Listings must be fresh: another host may have uploaded a checkpoint since we last looked.
            "use_listings_cache": False,
        }
        fs = fsspec.filesystem("s3", **options)  # s3fs; botocore reads AWS_* (keys, region, AWS_ENDPOINT_URL)
        bucket = rest.strip("/")
        if not bucket:
            raise ValueError("TRAINSERVE_STORAGE_URL s3:// needs a bucket: s3://bucket/prefix")
        return ArtifactStore(fs, bucket, settings.home)
    raise ValueError(f"TRAINSERVE_STORAGE_URL {url!r}: use a folder path, file:///path or s3://bucket/prefix")
