"""Out-of-memory handling, tested on the CPU by injecting CUDA's OOM error into the training step."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.factories import sentiment_rows, tsv_bytes
from tests.tiny_models import build_tiny_bert
from worker.engines.training import loop
from worker.engines.training.classifier import (
    OutOfMemory,
    TrainCallbacks,
    TrainConfig,
    split_micro_batches,
    train,
)


class Events(TrainCallbacks):
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def on_event(self, kind: str, message: str) -> None:
        self.events.append((kind, message))


def test_split_micro_batches_keeps_every_example_once():
    batches = [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert split_micro_batches(batches, 1) is batches
    assert split_micro_batches(batches, 2) == [[0, 1, 2], [3, 4], [5, 6], [7]]
    assert sorted(i for b in split_micro_batches(batches, 8) for i in b) == list(range(8))
    assert max(len(b) for b in split_micro_batches(batches, 8)) == 1


@pytest.fixture()
def setup(tmp_path):
    model = build_tiny_bert(tmp_path / "bert", dropout=0.0)
    data = tmp_path / "train.tsv"
    data.write_bytes(tsv_bytes(sentiment_rows(2)))

    def config(name: str) -> TrainConfig:
        return TrainConfig(base_model=str(model), train_file=data, eval_file=None, text_column="sentence",
                           label_column="label", output_dir=tmp_path / name / "out",
                           checkpoint_dir=tmp_path / name / "ckpt", epochs=1, batch_size=8, learning_rate=1e-3,
                           max_length=32, device="cpu", precision="fp32")
    return config


def _inject_oom(monkeypatch, largest_that_fits: int) -> list[int]:
    seen: list[int] = []
    real = loop.train_step

    def step(model, optimizer, scaler, plan, task, micro_batches, *rest, **kwargs):
        size = max(len(m) for m in micro_batches)
        seen.append(size)
        if size > largest_that_fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, optimizer, scaler, plan, task, micro_batches, *rest, **kwargs)

    monkeypatch.setattr(loop, "train_step", step)
    return seen


def test_oom_halves_the_micro_batch_and_keeps_the_effective_batch(setup, monkeypatch):
    reference = train(setup("reference"))
    seen = _inject_oom(monkeypatch, largest_that_fits=2)
    callbacks = Events()
    result = train(setup("oom"), callbacks)
    assert result.status == "completed" and result.global_step == reference.global_step == 3
    assert seen[:3] == [8, 4, 2] and set(seen[3:]) == {2}  # backs off once, then stays at 2
    assert [kind for kind, _ in callbacks.events].count("oom") == 2
    # Same examples per optimizer step, so (without dropout) the same weights up to summation order.
    ours = load_file(str(result.model_dir / "model.safetensors"))
    theirs = load_file(str(reference.model_dir / "model.safetensors"))
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-4, atol=1e-5)


def test_oom_at_one_example_fails_with_a_clear_error(setup, monkeypatch):
    _inject_oom(monkeypatch, largest_that_fits=0)
    with pytest.raises(OutOfMemory, match="micro-batch of one example"):
        train(setup("hopeless"))


def test_other_runtime_errors_are_not_mistaken_for_oom(setup, monkeypatch):
    def step(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(loop, "train_step", step)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        train(setup("other"))
