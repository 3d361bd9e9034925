"""Hub base models: safetensors only, within TRAINSERVE_MAX_MODEL_BYTES, online and from the offline cache.

Only the hub's edge is replaced: `huggingface_hub.model_info` online, a real cache folder offline.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import httpx
import huggingface_hub
import pytest
from huggingface_hub.errors import RepositoryNotFoundError
from huggingface_hub.hf_api import RepoSibling

from core.db import make_engine, make_sessionmaker
from core.errors import ValidationFailed
from core.served_models import resolve_served_model
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload

LIMIT = 10_000
REPOS = {
    "org/bin-only": {"config.json": 500, "pytorch_model.bin": 4_000},
    "org/huge": {"config.json": 500, "model.safetensors": LIMIT + 1, "pytorch_model.bin": 10},
    "org/huge-shards": {"config.json": 500, "model-00001-of-00002.safetensors": 6_000,
                        "model-00002-of-00002.safetensors": 6_000, "model.safetensors.index.json": 100},
    # model.safetensors is what loads; the fp16 variant and the onnx folder are never read
    "org/fine": {"config.json": 500, "model.safetensors": 9_000, "model.fp16.safetensors": 4_500,
                 "onnx/model.safetensors": 99_999},
}


@pytest.fixture()
def online_hub(monkeypatch, settings):
    """The hub answers model_info from REPOS; anything else does not exist."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    settings.max_model_bytes = LIMIT

    def model_info(repo_id, *, timeout=None, files_metadata=False, **_):
        assert files_metadata, "sizes are only listed with files_metadata=True"
        if repo_id not in REPOS:
            url = f"https://huggingface.co/api/models/{repo_id}"
            response = httpx.Response(404, request=httpx.Request("GET", url))
            raise RepositoryNotFoundError(f"404: {repo_id}", response=response)
        return SimpleNamespace(id=repo_id, siblings=[RepoSibling(rfilename=name, size=size)
                                                     for name, size in REPOS[repo_id].items()])

    monkeypatch.setattr(huggingface_hub, "model_info", model_info)


@pytest.fixture()
def dataset(client):
    return upload(client, tsv_bytes(sentiment_rows(2))).json()["id"]


def _create(client, dataset, base_model):
    return client.post("/jobs", json=job_body(dataset, base_model=base_model))


def test_hub_repo_without_safetensors_is_refused(client, dataset, online_hub):
    response = _create(client, dataset, "org/bin-only")
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "base_model" and "no .safetensors weights" in error["message"]


@pytest.mark.parametrize("repo", ["org/huge", "org/huge-shards"])
def test_hub_weights_over_the_limit_are_refused(client, dataset, online_hub, repo):
    response = _create(client, dataset, repo)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "base_model" and "TRAINSERVE_MAX_MODEL_BYTES" in error["message"]


def test_hub_repo_with_safetensors_within_the_limit_is_accepted(client, dataset, online_hub):
    response = _create(client, dataset, "org/fine")
    assert response.status_code == 201, response.text
    missing = _create(client, dataset, "org/missing").json()["error"]
    assert missing["message"] == "hub model 'org/missing' does not exist" and missing["field"] == "base_model"


def test_served_hub_models_are_checked_the_same_way(settings, online_hub):
    engine = make_engine(settings.resolved_database_url)
    try:
        with make_sessionmaker(engine)() as session:
            assert resolve_served_model(session, settings, name="org/fine", tenant=None).path == "org/fine"
            for repo in ("org/bin-only", "org/huge"):
                with pytest.raises(ValidationFailed) as refused:
                    resolve_served_model(session, settings, name=repo, tenant=None)
                assert refused.value.field == "model"
    finally:
        engine.dispose()


def _cache_repo(cache: Path, repo_id: str, files: dict[str, int]) -> None:
    """A hub cache entry laid out as huggingface_hub writes it (refs/main -> snapshots/<commit>/...)."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0" * 40)
    snapshot = root / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for name, size in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(b"{}" if name.endswith(".json") else b"\0" * size)


def test_offline_cache_needs_safetensors_within_the_limit(client, dataset, settings, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    settings.max_model_bytes = LIMIT
    for repo in ("org/bin-only", "org/huge", "org/fine"):
        _cache_repo(tmp_path / "hub", repo, REPOS[repo])
    assert "no .safetensors" in _create(client, dataset, "org/bin-only").json()["error"]["message"]
    assert "TRAINSERVE_MAX_MODEL_BYTES" in _create(client, dataset, "org/huge").json()["error"]["message"]
    assert _create(client, dataset, "org/fine").status_code == 201
    assert "no cached copy" in _create(client, dataset, "org/elsewhere").json()["error"]["message"]
