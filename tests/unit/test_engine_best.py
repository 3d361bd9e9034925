"""Best checkpoint and early stopping in the training loop: which weights are saved, what is pruned, resume."""

from __future__ import annotations

import dataclasses

import pytest
import safetensors.torch
import torch

from tests.unit.test_engine_training import Recorder, make_config, tiny_model  # noqa: F401 - fixture
from worker.engines.training.best import BestTracker
from worker.engines.training.classifier import train


def test_tracker_moves_on_any_gain_and_counts_patience_by_the_threshold():
    tracker = BestTracker("eval_loss", greater_is_better=False, patience=2, threshold=0.1)
    assert tracker.update(1, {"eval_loss": 1.0}) and tracker.bad_evaluations == 0
    assert tracker.update(2, {"eval_loss": 0.95})  # better, so the best moves ...
    assert tracker.bad_evaluations == 1 and not tracker.exhausted  # ... but not by more than the threshold
    assert not tracker.update(3, {"eval_loss": 0.97}) and tracker.exhausted
    assert tracker.best() == {"step": 2, "metric": "eval_loss", "value": 0.95}
    again = BestTracker("eval_loss", greater_is_better=False, patience=2, threshold=0.1)
    again.restore(tracker.state())
    assert again.best() == tracker.best() and again.exhausted
    with pytest.raises(ValueError, match="eval_f1"):
        BestTracker("eval_f1", greater_is_better=True).update(1, {"eval_loss": 1.0})


def _early_stopping_config(tmp_path, model):
    # A threshold of 1.0 on accuracy: no evaluation can improve by more, so patience 2 ends the run at the
    # third evaluation whatever the model learns; the best is still the highest accuracy (earliest on ties).
    return make_config(tmp_path, model, max_steps=8, eval_steps=1, checkpoint_steps=1, learning_rate=1e-2,
                       metric_for_best="eval_accuracy", greater_is_better=True, early_stopping_patience=2,
                       early_stopping_threshold=1.0)


def _tensors(path):
    return safetensors.torch.load_file(str(path / "model.safetensors"))


def test_early_stop_saves_the_best_evaluation_and_keeps_only_best_and_latest(tmp_path, tiny_model):  # noqa: F811
    recorder = Recorder()
    config = _early_stopping_config(tmp_path, tiny_model)
    result = train(config, recorder)

    assert (result.status, result.stop_reason, result.global_step) == ("completed", "early_stopping", 3)
    accuracies = [(metrics["eval_accuracy"], -step) for step, metrics in recorder.evals]
    best_step = -max(accuracies)[1]
    assert [step for step, _ in recorder.evals] == [1, 2, 3]  # no final evaluation after an early stop
    assert result.best == {"step": best_step, "metric": "eval_accuracy",
                           "value": dict(recorder.evals)[best_step]["eval_accuracy"]}
    assert result.metrics["eval_loss"] == dict(recorder.evals)[best_step]["eval_loss"]  # the best's metrics
    assert result.manifest["best"] == result.best and result.manifest["stop_reason"] == "early_stopping"
    assert [kind for kind, _ in recorder.events].count("early_stopping") == 1
    kept = sorted(p.name for p in config.checkpoint_dir.iterdir())
    assert kept == sorted({f"checkpoint-{best_step}", "checkpoint-3"})
    saved, best = _tensors(config.output_dir), _tensors(config.checkpoint_dir / f"checkpoint-{best_step}")
    assert all(torch.equal(saved[name], best[name]) for name in saved if name in best)


def test_best_and_patience_survive_a_resume_exactly(tmp_path, tiny_model):  # noqa: F811
    reference = train(_early_stopping_config(tmp_path / "full", tiny_model))
    parted = _early_stopping_config(tmp_path / "parted", tiny_model)
    assert train(parted, Recorder(stop_at=2)).status == "cancelled"
    resumer = Recorder()
    resumed = train(parted, resumer)
    # The checkpoint at step 2 carried one evaluation without improvement: one more ends the run at step 3.
    assert [step for step, _ in resumer.evals] == [3]
    assert (resumed.stop_reason, resumed.global_step, resumed.best) == ("early_stopping", 3, reference.best)
    expected, actual = _tensors(reference.model_dir), _tensors(resumed.model_dir)
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


def test_a_callback_can_end_the_run_early_with_its_reason(tmp_path, tiny_model):  # noqa: F811
    class Pruner(Recorder):
        def stop_reason(self):
            return "pruned" if len(self.evals) >= 2 else None

    recorder = Pruner()
    config = dataclasses.replace(_early_stopping_config(tmp_path, tiny_model), early_stopping_patience=None)
    result = train(config, recorder)
    assert (result.stop_reason, result.global_step) == ("pruned", 2)
    assert ("pruned" in [kind for kind, _ in recorder.events]) and (config.output_dir / "manifest.json").is_file()
