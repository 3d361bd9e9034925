"""CUDA paths of the engine: autocast dtype by capability, fp16 grad scaling. Skipped without CUDA."""

from __future__ import annotations

import pytest

from tests.factories import sentiment_rows, tsv_bytes
from tests.tiny_models import build_tiny_bert

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", ["auto", "fp16", "bf16", "fp32"])
def test_tiny_fine_tune_on_cuda(tmp_path, precision):
    import torch

    from worker.engines.device import resolve_device
    from worker.engines.training.classifier import TrainConfig, train

    plan = resolve_device("cuda:0", precision)
    if precision == "auto":
        assert plan.precision == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")
    assert plan.use_grad_scaler == (plan.precision == "fp16")
    data = tmp_path / "train.tsv"
    data.write_bytes(tsv_bytes(sentiment_rows(4)))
    result = train(TrainConfig(
        base_model=str(build_tiny_bert(tmp_path / "bert")), train_file=data, eval_file=data,
        text_column="sentence", label_column="label", output_dir=tmp_path / "out",
        checkpoint_dir=tmp_path / "ckpt", epochs=6, batch_size=8, learning_rate=1e-2, max_length=32,
        precision=precision, device="cuda:0"))
    assert result.status == "completed"
    assert result.metrics["eval_accuracy"] == 1.0
    assert result.manifest["precision"] == plan.precision
