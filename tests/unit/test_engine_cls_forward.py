"""The [CLS]-only last layer gives the full forward's loss and gradients on a tiny BERT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from tests.tiny_models import build_tiny_bert
from worker.engines.cls_forward import cls_only_loss, supports_cls_only


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny") / "model", seed=0, dropout=0.0)


def test_cls_only_loss_and_gradients_equal_the_full_forward(tiny_model):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=3, ignore_mismatched_sizes=True)
    assert supports_cls_only(model)
    model.train()  # dropout 0: both paths are deterministic
    input_ids = torch.randint(5, model.config.vocab_size, (4, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0  # padded rows: the mask must reach the last layer's keys
    attention_mask[3, 3:] = 0
    labels = torch.tensor([0, 2, 1, 2])

    full = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    full.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    fast = cls_only_loss(model, input_ids, attention_mask, labels)
    fast.backward()
    actual = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    assert fast.item() == pytest.approx(full.item(), abs=1e-6)
    assert actual.keys() == expected.keys()
    assert all(torch.allclose(actual[name], expected[name], atol=1e-6) for name in expected)

    unpadded = torch.ones_like(attention_mask)  # no mask at all (SDPA gets None)
    model.zero_grad(set_to_none=True)
    reference = model(input_ids=input_ids, attention_mask=unpadded, labels=labels).loss
    assert cls_only_loss(model, input_ids, unpadded, labels).item() == pytest.approx(reference.item(), abs=1e-6)


def test_other_models_keep_the_full_forward(tiny_model):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=2,
                                                               attn_implementation="eager")
    assert not supports_cls_only(model)
    assert not supports_cls_only(torch.nn.Linear(2, 2))
