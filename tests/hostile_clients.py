"""Hostile clients for tests against a real server: stalled sockets and a job with a large artifact to download."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import httpx

from core.db import session_scope
from core.rows import Artifact, new_id, utcnow
from tests.factories import job_body, sentiment_rows, tsv_bytes

ARTIFACT_BYTES = 8 * 1024 * 1024  # far more than the socket buffers hold: a client that stops reading stalls it


def job_with_artifact(base: str, key: str, home: Path, factory, folder_name: str = "model",
                      **job: Any) -> tuple[str, str, bytes]:
    """A job (through the API) with a model artifact of ARTIFACT_BYTES in the store; (job id, artifact id, data)."""
    auth = {"Authorization": f"Bearer {key}"}
    dataset = httpx.post(f"{base}/datasets", files={"file": ("t.tsv", tsv_bytes(sentiment_rows()))}, headers=auth)
    job_id = httpx.post(f"{base}/jobs", json=job_body(dataset.json()["id"], **job), headers=auth).json()["id"]
    data = os.urandom(ARTIFACT_BYTES)
    folder = home / "jobs" / job_id / folder_name
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(data)
    (folder / "config.json").write_text('{"model_type": "bert"}')
    artifact_id = new_id("art")
    with session_scope(factory) as session:
        session.add(Artifact(id=artifact_id, job_id=job_id, kind="model", path=f"jobs/{job_id}/{folder_name}",
                             size_bytes=len(data), files=["config.json", "model.safetensors"], created_at=utcnow()))
    return job_id, artifact_id, data


def stalled(base: str, raw_request: bytes, read: int = 0) -> socket.socket:
    """A client that sends `raw_request`, reads `read` bytes of the answer, then neither reads nor writes."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(raw_request)
    got = b""
    while len(got) < read:
        got += sock.recv(read - len(got))
    return sock


def download_request(job_id: str, artifact_id: str, key: str) -> bytes:
    return (f"GET /jobs/{job_id}/artifacts/{artifact_id}/download HTTP/1.1\r\nHost: t\r\n"
            f"Authorization: Bearer {key}\r\n\r\n").encode()
