"""The engine side of the job-kind registry (core.jobspec holds the rest): kind -> frozen config type, Recipe.

`build(kind, common, job, hp)` makes a kind's config: every field the config shares with the kind's
hyperparameters model comes from the model (so a new hyperparameter is one field in each), the rest from
`common` (paths, device, settings) and the kind's `from_row` (what its row resolved: base model, labels).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from core.rows import TaskKind
from worker.engines.lm_training import CausalLMRecipe, LMTrainConfig
from worker.engines.loop import Recipe, RunConfig
from worker.engines.training import ClassifierRecipe, TrainConfig


@dataclass(frozen=True)
class EngineKind:
    """One job kind as the engines run it."""

    config: type[RunConfig]
    task: Callable[[Any], Recipe]  # config -> the loop's Recipe
    # The job row's resolved fields -> config fields (base_model_path, label_column, model_config, ...).
    from_row: Callable[[Any], Mapping[str, Any]] = lambda row: {}


ENGINE_KINDS: dict[str, EngineKind] = {}


def register(name: str, kind: EngineKind) -> EngineKind:
    """Add the engine pieces of the job kind `name` (the same name as its core.jobspec entry)."""
    ENGINE_KINDS[name] = kind
    return kind


def engine_kind(name: str) -> EngineKind:
    """The engine pieces of a registered kind (KeyError for one this worker does not know)."""
    return ENGINE_KINDS[name]


def kind_name(config: RunConfig) -> str:
    """The registered name of a config's kind (the rank processes of a launch look it up by this)."""
    return next(name for name, kind in ENGINE_KINDS.items() if type(config) is kind.config)


def build(name: str, common: Mapping[str, Any], row: Any, hyperparameters: BaseModel) -> RunConfig:
    """The frozen config of a run of kind `name` from its typed hyperparameters, its row and `common`."""
    kind = ENGINE_KINDS[name]
    names = {f.name for f in dataclasses.fields(kind.config)}
    from_model = {key: value for key, value in hyperparameters.model_dump().items() if key in names}
    return kind.config(**{**from_model, **common, **kind.from_row(row)})


def run_task(config: RunConfig) -> Recipe:
    """The Recipe that runs `config`."""
    return ENGINE_KINDS[kind_name(config)].task(config)


register(TaskKind.TEXT_CLASSIFICATION, EngineKind(
    TrainConfig, ClassifierRecipe,
    lambda row: {"base_model": row.base_model_path, "label_column": row.label_column}))
register(TaskKind.CAUSAL_LM, EngineKind(
    LMTrainConfig, CausalLMRecipe,
    lambda row: {"base_model": row.base_model_path, "model_config": row.model_config_}))
