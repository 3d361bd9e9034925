"""A job's hyperparameters on their way from the row to the engine: validated back into the kind's model, mapped
onto the frozen config by the kind's one explicit mapping (an unknown key is an error, never dropped), and one set
of defaults per kind (the model's: every default an engine config keeps is pinned equal to it here)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import Field

from core.errors import ValidationFailed
from core.hyperparams import LMHyperparameters, TrainingHyperparameters, default
from core.jobspec import KINDS, stored_hyperparameters
from worker.engines.training import kinds
from worker.engines.training.causal_lm import LMTrainConfig
from worker.engines.training.chat import ChatTrainConfig
from worker.engines.training.classifier import TrainConfig
from worker.jobs.config import best_fields

COMMON: dict[str, Any] = {"train_file": Path("train.jsonl"), "eval_file": None, "output_dir": Path("out"),
                          "checkpoint_dir": Path("ckpt"), "text_column": "text", "device": "cpu"}
# A reinforcement method (the prompts entry needs its grader; every other entry reads past it).
METHOD = {"method": "reinforcement", "grader": {"type": "string_check", "name": "g", "input": "{{sample.output_text}}",
                                                "reference": "1", "operation": "eq"}}
ROW = SimpleNamespace(base_model_path="base", label_column="label", model_config_=None, adapter=None, method=METHOD)


def _task(entry: str) -> str:
    return entry.partition("/")[0]  # `<kind>/chat` runs jobs of <kind>


def _config(entry: str, stored: dict[str, Any]) -> Any:
    hp = stored_hyperparameters(_task(entry), stored)
    return kinds.build(entry, {**COMMON, **best_fields(_task(entry), hp)}, ROW, hp)


@pytest.mark.parametrize("entry", sorted(kinds.ENGINE_KINDS))
def test_every_hyperparameter_reaches_the_config_by_the_kinds_mapping(entry):
    model = KINDS[_task(entry)].hyperparameters
    hp = model()
    mapping = kinds.ENGINE_KINDS[entry].hyperparameters
    assert set(mapping) == set(model.model_fields)  # every field placed, or marked as carried elsewhere
    config = _config(entry, hp.model_dump(mode="json"))
    for field, target in mapping.items():
        if target is not None:
            assert getattr(config, target) == getattr(hp, field), field


@pytest.mark.parametrize("entry", sorted(kinds.ENGINE_KINDS))
def test_a_config_keeps_no_default_of_its_own(entry):
    """A default an engine config keeps for direct callers is its kind's model's, field by field."""
    model = KINDS[_task(entry)].hyperparameters
    fields = {f.name: f for f in dataclasses.fields(kinds.ENGINE_KINDS[entry].config)}
    for name, target in kinds.ENGINE_KINDS[entry].hyperparameters.items():
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
    with pytest.raises(kinds.UnknownHyperparameter, match="label_smoothing"):
        kinds.build("causal-lm", COMMON, ROW, _Wider())


def test_a_mapping_onto_a_field_the_config_lacks_is_refused_when_registered():
    entry = kinds.ENGINE_KINDS["text-classification"]
    with pytest.raises(kinds.UnknownHyperparameter, match="label_smoothing"):
        kinds.register("wider", dataclasses.replace(entry, hyperparameters={
            **entry.hyperparameters, "label_smoothing": "label_smoothing"}))
    assert "wider" not in kinds.ENGINE_KINDS


def test_a_field_set_by_two_parts_of_the_config_is_an_error():
    hp = stored_hyperparameters("text-classification", {})
    with pytest.raises(ValueError, match="seed set twice"):
        kinds.build("text-classification", {**COMMON, "seed": 1}, ROW, hp)


def test_a_row_from_before_metric_for_best_keeps_its_last_model():
    old = _config("text-classification", {"epochs": 1})
    assert old.metric_for_best is None
    new = _config("text-classification", {"metric_for_best": "eval_f1"})
    assert (new.metric_for_best, new.greater_is_better) == ("eval_f1", True)
    assert isinstance(new, TrainConfig) and new.base_model == "base" and new.label_column == "label"


def test_the_shared_mapping_covers_what_every_kind_shares():
    assert set(kinds.RUN_HYPERPARAMETERS) == set(TrainingHyperparameters.model_fields)
