"""Checkpoints and models between hosts through a real S3 server (moto): what a second host resumes from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from core.errors import StorageUnavailable
from core.paths import job_checkpoints_dir, job_dir
from core.settings import Settings
from core.storage import ArtifactStore, open_storage
from worker.engines.training.artifacts import STATE, latest_checkpoint
from worker.jobs.sync import clear_work, pull_checkpoint, push_checkpoint, push_model, stored_checkpoints
from worker.model_store import fetch_model

JOB = "job_0123456789abcdef01234567"


def _host(s3_url: str, home: Path) -> tuple[Settings, ArtifactStore]:
    settings = Settings(home=home, storage_url=s3_url)
    return settings, open_storage(settings)


def _checkpoint(settings: Settings, step: int) -> Path:
    """A checkpoint folder as the engine leaves it: weights, then state.json last."""
    folder = job_checkpoints_dir(settings, JOB) / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes([step]) * 64)
    (folder / STATE).write_text(json.dumps({"step": step}))
    return folder


def test_a_second_host_resumes_from_the_newest_complete_checkpoint(s3_url, tmp_path, monkeypatch):
    a_settings, a = _host(s3_url, tmp_path / "a")
    for step in (5, 10, 15):
        path = _checkpoint(a_settings, step)
        if step == 15:  # the engine keeps the latest and the best (say 10) and prunes the rest
            shutil.rmtree(path.parent / "checkpoint-5")
        push_checkpoint(a, JOB, path)
    assert stored_checkpoints(a, JOB) == [10, 15]  # the store keeps what the engine keeps
    # Host A dies while uploading step 20: its weights are stored, its state.json is not.
    put = a._put

    def dies_before_the_marker(local: Path, key: str) -> None:
        if key.endswith(STATE):
            raise ConnectionResetError("host died")
        put(local, key)

    monkeypatch.setattr(a, "_put", dies_before_the_marker)
    with pytest.raises(StorageUnavailable):
        push_checkpoint(a, JOB, _checkpoint(a_settings, 20))
    assert a.files(f"jobs/{JOB}/checkpoints/checkpoint-20") == [("model.safetensors", 64)]
    assert stored_checkpoints(a, JOB) == [10, 15]

    b_settings, b = _host(s3_url, tmp_path / "b")
    assert pull_checkpoint(b, b_settings, JOB) == 15
    resumed = latest_checkpoint(job_checkpoints_dir(b_settings, JOB))
    assert resumed is not None and resumed.name == "checkpoint-15"
    assert (resumed / "model.safetensors").read_bytes() == bytes([15]) * 64
    assert pull_checkpoint(b, b_settings, JOB) is None  # already here: nothing downloaded again


def test_a_finished_model_is_served_from_the_store_and_the_work_folder_is_cleared(s3_url, tmp_path):
    a_settings, a = _host(s3_url, tmp_path / "a")
    model = job_dir(a_settings, JOB) / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="not in the artifact store"):
        fetch_model(a, JOB)
    (model / "manifest.json").write_text("{}")
    push_model(a, JOB, model)
    clear_work(a, a_settings, JOB)
    assert not job_dir(a_settings, JOB).exists()

    b_settings, b = _host(s3_url, tmp_path / "b")
    served = fetch_model(b, JOB)
    assert served == tmp_path / "b" / "cache" / "jobs" / JOB / "model"
    assert sorted(p.name for p in served.iterdir()) == ["config.json", "manifest.json"]
