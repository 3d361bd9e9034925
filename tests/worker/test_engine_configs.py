"""A job on its way from the row to the engine: resolved into a typed `ResolvedJob` (its hyperparameters validated
back into the kind's model), mapped onto the frozen config by the entry's one explicit mapping (an unknown key is an
error, never dropped), and one set of defaults per kind (the model's: every default an engine config keeps is pinned
equal to it here)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from pydantic import Field

from core.errors import ValidationFailed
from core.hyperparams import LMHyperparameters, TrainingHyperparameters, default
from core.jobspec import KINDS, ResolvedJob, stored_hyperparameters
from core.reinforcement import ReinforcementConfig
from core.rows import Job
from worker.engines.training import kinds
from worker.engines.training.causal_lm import LMTrainConfig
from worker.engines.training.chat import ChatTrainConfig
from worker.engines.training.classifier import TrainConfig
from worker.jobs.config import resolve_job

COMMON: dict[str, Any] = {"train_file": Path("train.jsonl"), "eval_file": None, "output_dir": Path("out"),
                          "checkpoint_dir": Path("ckpt"), "device": "cpu"}
# A reinforcement method (the prompts entry needs its grader; every other entry reads past it).
METHOD = ReinforcementConfig.model_validate({
    "method": "reinforcement", "grader": {"type": "string_check", "name": "g", "input": "{{sample.output_text}}",
                                          "reference": "1", "operation": "eq"}})
ENTRIES = sorted(name for kind in KINDS.values() for name in kind.engines)


def _task(entry: str) -> str:
    return entry.partition("/")[0]  # `<kind>/chat` runs jobs of <kind>


def _job(task: str, stored: dict[str, Any]) -> ResolvedJob:
    """A stored row of kind `task`, resolved as the worker resolves it."""
    return resolve_job(Job(id="job_0", task=task, hyperparameters=stored, text_column="text", devices=1,
                           base_model="base", base_model_path="base", label_column="label", model_config_=None,
                           adapter=None, method=METHOD))


def _config(entry: str, stored: dict[str, Any]) -> Any:
    return kinds.build(entry, COMMON, _job(_task(entry), stored))


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_hyperparameter_reaches_the_config_by_the_kinds_mapping(entry):
    model = KINDS[_task(entry)].hyperparameters
    hp = model()
    mapping = kinds.engine_kind(entry).hyperparameters
    assert set(mapping) == set(model.model_fields)  # every field placed, or marked as carried elsewhere
    config = _config(entry, hp.model_dump(mode="json"))
    for field, target in mapping.items():
        if target is not None:
            assert getattr(config, target) == getattr(hp, field), field


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_config_keeps_no_default_of_its_own(entry):
    """A default an engine config keeps for direct callers is its kind's model's, field by field."""
    model = KINDS[_task(entry)].hyperparameters
    fields = {f.name: f for f in dataclasses.fields(kinds.engine_kind(entry).config)}
    for name, target in kinds.engine_kind(entry).hyperparameters.items():
        if target is None:
            continue
        field = fields[target]
        if field.default is not dataclasses.MISSING:
            assert field.default == default(model, name), f"{entry}: {target}"
        assert field.default_factory is dataclasses.MISSING, f"{entry}: {target}"


def test_chat_jobs_have_the_causal_lm_defaults():
    chat = ChatTrainConfig(train_file=Path("t"), eval_file=None, output_dir=Path("o"), checkpoint_dir=Path("c"),
                           base_model="base")
    lm = LMTrainConfig(train_file=Path("t"), eval_file=None, output_dir=Path("o"), checkpoint_dir=Path("c"))
    for name in ("epochs", "batch_size", "learning_rate", "weight_decay", "seed"):
        assert getattr(chat, name) == getattr(lm, name) == default(LMHyperparameters, name), name
    built = _config("causal-lm/chat", {"block_size": 96, "epochs": 2})
    assert (built.max_length, built.epochs, built.batch_size) == (96, 2, default(LMHyperparameters, "batch_size"))


def test_a_stored_key_the_kinds_model_does_not_take_is_an_error_naming_it():
    with pytest.raises(ValidationFailed) as refused:
        stored_hyperparameters("causal-lm", {"epochs": 2, "dropout_rate": 0.1})
    assert refused.value.field == "hyperparameters.dropout_rate"
    with pytest.raises(ValidationFailed) as refused:
        stored_hyperparameters("text-classification", {"learning_rate": 7})
    assert refused.value.field == "hyperparameters.learning_rate"


class _Wider(LMHyperparameters):
    label_smoothing: float = Field(0.0)


def test_a_hyperparameter_the_engine_mapping_does_not_name_is_refused_not_dropped():
    job = dataclasses.replace(_job("causal-lm", {}), hyperparameters=_Wider())
    with pytest.raises(kinds.UnknownHyperparameter, match="label_smoothing"):
        kinds.build("causal-lm", COMMON, job)


def test_a_mapping_onto_a_field_the_config_lacks_is_refused_when_defined():
    entry = kinds.CLASSIFICATION
    with pytest.raises(kinds.UnknownHyperparameter, match="label_smoothing"):
        dataclasses.replace(entry, hyperparameters={**entry.hyperparameters, "label_smoothing": "label_smoothing"})


def test_a_field_set_by_two_parts_of_the_config_is_an_error():
    with pytest.raises(ValueError, match="seed set twice"):
        kinds.build("text-classification", {**COMMON, "seed": 1}, _job("text-classification", {}))


def test_a_row_from_before_metric_for_best_keeps_its_last_model():
    old = _config("text-classification", {"epochs": 1})
    assert old.metric_for_best is None
    new = _config("text-classification", {"metric_for_best": "eval_f1"})
    assert (new.metric_for_best, new.greater_is_better) == ("eval_f1", True)
    assert isinstance(new, TrainConfig) and new.base_model == "base" and new.label_column == "label"


def test_the_shared_mapping_covers_what_every_kind_shares():
    assert set(kinds.RUN_HYPERPARAMETERS) == set(TrainingHyperparameters.model_fields)


def test_the_engine_takes_the_resolved_job_typed_never_the_row():
    """What an entry reads of a job is a field of ResolvedJob (mypy checks each `from_job`), typed by its model."""
    job = _job("causal-lm", {"epochs": 2})
    assert isinstance(job.method, ReinforcementConfig) and job.hyperparameters.epochs == 2
    assert isinstance(job.hyperparameters, LMHyperparameters)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.kind = "text-classification"  # type: ignore[misc]
    prompts = _config("causal-lm/prompts", {})
    assert prompts.reinforcement is job.method and prompts.base_model == "base"
    with pytest.raises(ValueError, match="method reinforcement"):
        kinds.build("causal-lm/prompts", COMMON, dataclasses.replace(job, method=None))
