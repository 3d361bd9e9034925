"""Artifact downloads: a job's model or checkpoint folder, streamed from the artifact store as a tar archive.

The route reads the artifact's row and lists its files, gives its database connection back, and only then
streams: each file's tar header, then the file read from the store in chunks (in a worker thread, one chunk
at a time), then padding. Nothing is copied to a temporary file, memory stays at one chunk, the size is
known up front (Content-Length), and a tenant holds at most TRAINSERVE_MAX_DOWNLOADS_PER_TENANT downloads.
"""

from __future__ import annotations

import tarfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import PurePosixPath

import anyio
from sqlalchemy.orm import Session
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from core.auth import Principal
from core.errors import NotFound, StorageUnavailable
from core.storage import ArtifactStore
from core.store import jobs as store

CHUNK = 256 * 1024
BLOCK = tarfile.BLOCKSIZE  # 512: every member's data is padded to it
RECORD = tarfile.RECORDSIZE  # 10240: the archive is padded to it, as tarfile writes it


@dataclass(frozen=True)
class Download:
    """What streaming an artifact needs; read from the database before the session is released."""

    key: str
    kind: str
    filename: str
    files: tuple[tuple[str, int], ...] = ()

    def members(self) -> list[tuple[bytes, str, int]]:
        """(tar header, store key, size) of every file, in archive order."""
        result = []
        for name, size in self.files:
            info = tarfile.TarInfo(str(PurePosixPath(self.kind) / name))
            info.size = size
            result.append((info.tobuf(format=tarfile.PAX_FORMAT), f"{self.key}/{name}", size))
        return result

    @property
    def size(self) -> int:
        """Bytes of the whole archive: headers, padded data, the two end blocks, padded to a record."""
        body = sum(len(header) + _padded(size) for header, _, size in self.members()) + 2 * BLOCK
        return _padded(body, RECORD)


def _padded(size: int, unit: int = BLOCK) -> int:
    return -(-size // unit) * unit


def find_download(session: Session, principal: Principal, *, job_id: str, artifact_id: str) -> Download:
    """The artifact's key, kind and download name (404 when the job or artifact is not the caller's)."""
    store.get_job(session, job_id=job_id, tenant=principal.scope)
    artifact = store.get_artifact(session, job_id=job_id, artifact_id=artifact_id)
    step = f"-{artifact.step}" if artifact.step else ""
    return Download(key=artifact.path, kind=artifact.kind, filename=f"{job_id}-{artifact.kind}{step}.tar")


def list_files(storage: ArtifactStore, download: Download, *, artifact_id: str) -> Download:
    """The download with its files listed from the store (no database session needed: call after releasing it)."""
    try:
        files = storage.files(download.key)  # keys are checked to stay under the store's root
    except (OSError, ValueError) as exc:
        raise StorageUnavailable(f"could not list artifact {artifact_id!r} in {storage.url}: {exc}") from exc
    if not files:
        raise NotFound(f"artifact {artifact_id!r} is no longer stored (checkpoints are rotated)")
    return Download(download.key, download.kind, download.filename, tuple(files))


async def tar_stream(storage: ArtifactStore, download: Download) -> AsyncIterator[bytes]:
    """The archive, chunk by chunk; a file that shrank or vanished since the listing ends the stream early
    (the client sees fewer bytes than Content-Length, never a corrupt archive that looks complete)."""
    written = 0
    for header, key, size in download.members():
        written += len(header) + _padded(size)
        yield header
        stream = await anyio.to_thread.run_sync(storage.open, key)
        try:
            left = size
            while left:
                chunk = await anyio.to_thread.run_sync(stream.read, min(CHUNK, left))
                if not chunk:
                    raise StorageUnavailable(f"{key} is shorter than listed; it changed during the download")
                left -= len(chunk)
                yield chunk
        finally:
            await anyio.to_thread.run_sync(stream.close)
        if _padded(size) > size:
            yield bytes(_padded(size) - size)
    yield bytes(download.size - written)  # the two end-of-archive blocks and the record padding


class SlotResponse(StreamingResponse):
    """A streaming response that gives its download slot back however it ends (done, error or disconnect)."""

    def __init__(self, content: AsyncIterator[bytes], *, release: Callable[[], None], **kwargs: object) -> None:
        super().__init__(content, **kwargs)  # type: ignore[arg-type]
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()
