"""Training shortcuts for BERT classifiers: same outputs and gradients as the library's forward."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, BertModel

from worker.engines.device import DevicePlan
from worker.engines.training.encoder import attention_implementation, last_layer_at_cls


def tiny_classifier(attention: str, *, dropout: float = 0.0, seed: int = 0) -> BertForSequenceClassification:
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout, num_labels=3, attn_implementation=attention)
    torch.manual_seed(seed)
    return BertForSequenceClassification(config)


def batch(seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (6, 11), generator=generator)
    mask = torch.ones_like(ids)
    for row, length in enumerate([11, 9, 4, 11, 1, 7]):  # padded rows, one of a single token
        mask[row, length:] = 0
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.randint(0, 3, (6,), generator=generator)}


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_last_layer_at_cls_gives_the_same_loss_logits_and_gradients(attention):
    reference = tiny_classifier(attention)
    shortcut = copy.deepcopy(reference)
    assert last_layer_at_cls(shortcut)
    inputs = batch()
    expected, got = reference(**inputs), shortcut(**inputs)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-6)
    expected.loss.backward()
    got.loss.backward()
    for (name, a), (_, b) in zip(reference.named_parameters(), shortcut.named_parameters(), strict=True):
        if a.grad is None:
            assert b.grad is None, name
            continue
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    # The parameters and what is saved are the library's own: only the module's forward was replaced.
    assert list(shortcut.state_dict()) == list(reference.state_dict())
    assert "forward" in vars(shortcut.bert.encoder.layer[-1]) and "forward" not in vars(shortcut.bert.encoder.layer[0])


def test_last_layer_at_cls_under_bf16_autocast_stays_close():
    reference = tiny_classifier("eager")
    shortcut = copy.deepcopy(reference)
    last_layer_at_cls(shortcut)
    inputs = batch(seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = reference(**inputs).logits.float(), shortcut(**inputs).logits.float()
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.02)


def test_training_with_dropout_still_learns_with_the_shortcut():
    model = tiny_classifier("eager", dropout=0.1)
    assert last_layer_at_cls(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    inputs = batch(seed=3)
    first = None
    for _ in range(40):
        loss = model(**inputs).loss
        first = first if first is not None else loss.item()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert loss.item() < first / 4


def test_models_it_was_not_checked_against_keep_their_forward():
    assert not last_layer_at_cls(BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                      intermediate_size=64)))
    relative = tiny_classifier("eager")
    relative.config.position_embedding_type = "relative_key"
    assert not last_layer_at_cls(relative)


def test_attention_implementation_is_eager_on_a_cpu_only():
    def plan(device: str, precision: str, dtype: torch.dtype | None) -> DevicePlan:
        return DevicePlan(device=device, precision=precision, autocast_dtype=dtype, use_grad_scaler=False)

    assert attention_implementation(plan("cpu", "bf16", torch.bfloat16)) == "eager"
    assert attention_implementation(plan("cpu", "fp32", None)) == "eager"
    assert attention_implementation(plan("cuda:0", "bf16", torch.bfloat16)) is None
