"""The training loop end to end on a tiny BERT: artifacts, learning, cancel, resume, accumulation."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import get_linear_schedule_with_warmup

from tests.tiny_models import build_tiny_bert
from worker.engines.encoders.classifier import Classifier, ClassifierCache
from worker.engines.training.classifier import TrainCallbacks, TrainConfig, classification_metrics, lr_at, train

POSITIVE = ["a great and wonderful film", "i loved it", "brilliant and moving", "superb acting , lovely story"]
NEGATIVE = ["a terrible boring mess", "i hated it", "awful and painful", "the worst movie of the year"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tiny_model_no_dropout(tmp_path_factory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-nodrop") / "model", seed=0, dropout=0.0)


def write_tsv(path: Path, copies: int = 4, labels: tuple = ("pos", "neg")) -> Path:
    lines = ["sentence\tlabel"]
    for _ in range(copies):
        lines += [f"{text}\t{labels[0]}" for text in POSITIVE] + [f"{text}\t{labels[1]}" for text in NEGATIVE]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def make_config(tmp_path: Path, model: Path, **overrides) -> TrainConfig:
    train_file = overrides.pop("train_file", None) or write_tsv(tmp_path / "train.tsv")
    values = dict(base_model=str(model), train_file=train_file, eval_file=train_file, text_column="sentence",
                  label_column="label", output_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt",
                  epochs=2, batch_size=8, learning_rate=3e-3, seed=3, base_model_name="tiny-bert",
                  dataset_hashes={"train": "sha256:abc"},
                  precision="fp32")  # "auto" may pick bf16 on a CPU with native bf16; tested on its own
    values.update(overrides)
    return TrainConfig(**values)


class Recorder(TrainCallbacks):
    """Keeps every callback it receives; stops after `stop_at` steps when set."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at = stop_at
        self.info: dict = {}
        self.logs: list[tuple[int, float, dict]] = []
        self.evals: list[tuple[int, dict]] = []
        self.checkpoints: list[tuple[int, Path]] = []
        self.events: list[tuple[str, str]] = []

    def on_start(self, info):
        self.info = info

    def on_log(self, step, epoch, metrics):
        self.logs.append((step, epoch, metrics))

    def on_eval(self, step, metrics):
        self.evals.append((step, metrics))

    def on_checkpoint(self, step, path):
        self.checkpoints.append((step, path))

    def on_event(self, kind, message):
        self.events.append((kind, message))

    def should_stop(self):
        return self.stop_at is not None and len(self.logs) >= self.stop_at


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(model_dir / "model.safetensors"))


def test_lr_schedule_matches_transformers_linear_schedule():
    assert [lr_at(s, 10, 0, 1.0) for s in (0, 5, 9, 10)] == [1.0, 0.5, 0.1, 0.0]
    assert [lr_at(s, 10, 2, 1.0) for s in (0, 1, 2, 6)] == [0.0, 0.5, 1.0, 0.5]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-5)
    schedule = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=3, num_training_steps=17)
    for step in range(17):
        assert math.isclose(lr_at(step, 17, 3, 2e-5), optimizer.param_groups[0]["lr"], rel_tol=1e-12)
        optimizer.step()
        schedule.step()


def test_classification_metrics_binary_and_macro():
    import numpy as np

    binary = classification_metrics(np.array([1, 1, 0, 0]), np.array([1, 0, 0, 0]), 2)
    assert binary == {"eval_accuracy": 0.75, "eval_f1": pytest.approx(2 / 3)}  # F1 of label id 1
    macro = classification_metrics(np.array([0, 1, 2, 2]), np.array([0, 1, 2, 1]), 3)
    assert macro["eval_f1"] == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)


def test_run_to_completion_writes_model_manifest_and_predicts_labels(tmp_path, tiny_model):
    recorder = Recorder()
    config = make_config(tmp_path, tiny_model, eval_steps=3)
    result = train(config, recorder)

    assert (result.status, result.global_step, result.total_steps) == ("completed", 8, 8)
    assert recorder.info["labels"] == ["neg", "pos"] and recorder.info["resumed_from_step"] is None
    assert [step for step, _, _ in recorder.logs] == list(range(1, 9))
    assert recorder.logs[-1][1] == 2.0  # epoch
    assert set(recorder.logs[0][2]) >= {"train_loss", "learning_rate", "samples_per_second"}
    assert [step for step, _ in recorder.evals] == [3, 6, 8]
    assert set(result.metrics) >= {"train_loss", "eval_loss", "eval_accuracy", "eval_f1",
                                   "train_samples_per_second", "train_runtime"}

    manifest = json.loads((config.output_dir / "manifest.json").read_text())
    assert manifest == result.manifest
    assert manifest["labels"] == ["neg", "pos"] and manifest["task"] == "text-classification"
    assert manifest["base_model_name"] == "tiny-bert" and manifest["dataset_hashes"] == {"train": "sha256:abc"}
    assert manifest["hyperparameters"]["total_steps"] == 8 and manifest["precision"] == "fp32"
    assert set(manifest["versions"]) == {"torch", "transformers", "datasets", "python"}
    assert (config.output_dir / "model.safetensors").is_file()
    assert (config.output_dir / "tokenizer.json").is_file()

    predictions = Classifier(config.output_dir, device="cpu").predict(["i loved it", "awful", "i hated it"])
    assert [p["label"] for p in predictions if p["label"] not in ("neg", "pos")] == []
    assert all(0.5 <= p["score"] <= 1.0 for p in predictions)


def test_learning_happens_and_int_labels_round_trip(tmp_path, tiny_model):
    train_file = write_tsv(tmp_path / "train.tsv", labels=(1, 0))
    config = make_config(tmp_path, tiny_model, train_file=train_file, epochs=10, learning_rate=1e-2)
    recorder = Recorder()
    result = train(config, recorder)

    assert result.metrics["eval_accuracy"] == 1.0
    first, last = recorder.logs[0][2]["train_loss"], recorder.logs[-1][2]["train_loss"]
    assert last < first - 0.1
    assert result.manifest["labels"] == [0, 1]
    texts = ["i loved it", "a terrible boring mess", "brilliant and moving", "i hated it"]
    predictions = Classifier(config.output_dir, device="cpu").predict(texts, batch_size=3)
    assert [p["label"] for p in predictions] == [1, 0, 1, 0]  # ints, in input order


def test_eval_labels_must_occur_in_training_data(tmp_path, tiny_model):
    eval_file = tmp_path / "eval.tsv"
    eval_file.write_text("sentence\tlabel\ngood\tpos\nmeh\tneutral\n")
    with pytest.raises(ValueError, match="'neutral' does not occur"):
        train(make_config(tmp_path, tiny_model, eval_file=eval_file))


def test_cancel_saves_a_checkpoint_and_resume_matches_an_uninterrupted_run(tmp_path, tiny_model):
    full = make_config(tmp_path / "full", tiny_model, train_file=write_tsv(tmp_path / "train.tsv"))
    reference = train(full)

    parted = dataclasses.replace(full, output_dir=tmp_path / "parted" / "out",
                                 checkpoint_dir=tmp_path / "parted" / "ckpt")
    stopper = Recorder(stop_at=3)
    cancelled = train(parted, stopper)
    assert (cancelled.status, cancelled.global_step, cancelled.model_dir) == ("cancelled", 3, None)
    assert [step for step, _ in stopper.checkpoints] == [3]
    assert (parted.checkpoint_dir / "checkpoint-3" / "model.safetensors").is_file()
    assert not (parted.output_dir / "manifest.json").exists()

    resumer = Recorder()
    resumed = train(parted, resumer)
    assert resumer.info["resumed_from_step"] == 3 and resumer.events[0][0] == "resumed"
    assert [step for step, _, _ in resumer.logs] == list(range(4, 9))
    assert (resumed.status, resumed.global_step) == ("completed", reference.global_step)
    # Exact equality: weights, optimizer moments, RNG (dropout masks) and data order all carried over.
    expected, actual = weights(reference.model_dir), weights(resumed.model_dir)
    assert all(torch.equal(expected[name], actual[name]) for name in expected)
    assert resumed.metrics["train_loss"] == pytest.approx(reference.metrics["train_loss"], rel=1e-6)


def test_periodic_checkpoints_keep_only_the_latest_without_a_best(tmp_path, tiny_model):
    recorder = Recorder()
    config = make_config(tmp_path, tiny_model, max_steps=4, checkpoint_steps=1, eval_file=None)
    result = train(config, recorder)
    assert [step for step, _ in recorder.checkpoints] == [1, 2, 3, 4]
    assert sorted(p.name for p in config.checkpoint_dir.iterdir()) == ["checkpoint-4"]  # no eval set, no best
    assert "eval_accuracy" not in result.metrics
    # A rerun finds the final checkpoint and only writes the model again.
    again = train(config, Recorder())
    assert (again.status, again.global_step) == ("completed", 4)


def test_gradient_accumulation_equals_one_larger_batch(tmp_path, tiny_model_no_dropout):
    train_file = write_tsv(tmp_path / "train.tsv", copies=3)  # 24 rows: 3 steps of 8
    accumulated = make_config(tmp_path / "acc", tiny_model_no_dropout, train_file=train_file, batch_size=4,
                              gradient_accumulation_steps=2, max_steps=3, eval_file=None)
    single = make_config(tmp_path / "one", tiny_model_no_dropout, train_file=train_file, batch_size=8,
                         max_steps=3, eval_file=None)
    a, b = train(accumulated), train(single)
    assert a.global_step == b.global_step == 3
    assert a.metrics["train_loss"] == pytest.approx(b.metrics["train_loss"], abs=1e-5)
    wa, wb = weights(a.model_dir), weights(b.model_dir)
    assert all(torch.allclose(wa[name], wb[name], atol=1e-5) for name in wa)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_path_on_cpu(tmp_path, tiny_model, precision):
    result = train(make_config(tmp_path, tiny_model, max_steps=2, batch_size=4, precision=precision))
    assert result.status == "completed" and result.manifest["precision"] == precision
    assert math.isfinite(result.metrics["train_loss"]) and math.isfinite(result.metrics["eval_loss"])
    classifier = Classifier(result.model_dir, device="cpu")
    assert classifier.model.dtype == torch.float32  # weights stay fp32; autocast only in forward


def test_classifier_cache_is_a_small_lru(tmp_path, tiny_model):
    first = train(make_config(tmp_path / "a", tiny_model, max_steps=1, eval_file=None)).model_dir
    second = train(make_config(tmp_path / "b", tiny_model, max_steps=1, eval_file=None)).model_dir
    cache = ClassifierCache(max_entries=1, device="cpu")
    one = cache.get(first)
    assert cache.get(first) is one and len(cache) == 1
    cache.get(second)
    assert len(cache) == 1 and cache.get(first) is not one
    assert cache.get(first).predict([]) == []


def test_freeze_word_embeddings_keeps_the_table_and_trains_the_rest(tmp_path, tiny_model):
    result = train(make_config(tmp_path, tiny_model, max_steps=3, eval_file=None, freeze_word_embeddings=True))
    before, after = weights(tiny_model), weights(result.model_dir)
    table = "bert.embeddings.word_embeddings.weight"
    assert torch.equal(after[table], before[table])  # frozen: no gradient, no AdamW decay
    assert result.manifest["hyperparameters"]["freeze_word_embeddings"] is True
    changed = [name for name in before if name in after and not torch.equal(before[name], after[name])]
    assert "bert.embeddings.position_embeddings.weight" in changed
    assert "bert.encoder.layer.0.attention.self.query.weight" in changed
