"""The engine side of the job-kind registry (core.jobspec holds the rest): kind -> frozen config type, Recipe.

`build(kind, common, job, hp)` makes a kind's config from three disjoint parts: its typed hyperparameters through
the entry's one explicit `hyperparameters` mapping (each field of the kind's model -> the config field it sets, or
None where another part carries it), `common` (paths, device, settings: those the config has) and the entry's
`from_row` (what its row resolved: base model, labels, adapter, method). A hyperparameter the mapping does not
name is an error, never dropped; the configs take every value from the model, so its defaults are the only ones.

A kind may train differently on chat data (core.chat_data's formats): its entry `<kind>/chat`
(`engine_name`) then runs those jobs, e.g. causal-lm over chat, completion or preference records is chat SFT or
DPO (worker.engines.training.chat), over a text corpus next-token training (worker.engines.training.causal_lm).
A kind from a plugin module registers here from its core entry's `engine_module` (`load_plugins`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from core.adapters import AdapterConfig, PreferenceConfig
from core.chat_data import CHAT_FORMATS
from core.jobspec import KINDS, load_kind_modules
from core.reinforcement import ReinforcementConfig
from core.vocab import TaskKind
from worker.engines.training.causal_lm import CausalLMRecipe, LMTrainConfig
from worker.engines.training.chat import ChatRecipe, ChatTrainConfig
from worker.engines.training.classifier import ClassifierRecipe, TrainConfig
from worker.engines.training.loop import Recipe, RunConfig
from worker.engines.training.reinforcement import ReinforcementRecipe, ReinforcementTrainConfig

# What every kind's hyperparameters share (TrainingHyperparameters) -> RunConfig's fields; metric_for_best is
# None: the worker resolves it with its direction (or none, for a row from before it: worker.jobs.config).
RUN_HYPERPARAMETERS: Mapping[str, str | None] = {
    "max_steps": "max_steps", "warmup_ratio": "warmup_ratio",
    "gradient_accumulation_steps": "gradient_accumulation_steps", "precision": "precision",
    "eval_steps": "eval_steps", "metric_for_best": None, "early_stopping_patience": "early_stopping_patience",
    "early_stopping_threshold": "early_stopping_threshold"}


class UnknownHyperparameter(ValueError):
    """A hyperparameter the kind's engine mapping does not name (or a mapping that names a missing field)."""


def same_names(*names: str) -> dict[str, str]:
    """Mapping entries for hyperparameters whose config field has the same name."""
    return {name: name for name in names}


@dataclass(frozen=True)
class EngineKind:
    """One job kind as the engines run it."""

    config: type[RunConfig]
    task: Callable[[Any], Recipe]  # config -> the loop's Recipe
    # Every field of the kind's hyperparameters model -> the config field it sets (None: not the config's).
    hyperparameters: Mapping[str, str | None]
    # The job row's resolved fields -> config fields (base_model_path, label_column, model_config, ...).
    from_row: Callable[[Any], Mapping[str, Any]] = lambda row: {}


ENGINE_KINDS: dict[str, EngineKind] = {}


def register(name: str, kind: EngineKind) -> EngineKind:
    """Add the engine pieces of the job kind `name` (the same name as its core.jobspec entry, or `<name>/chat`);
    UnknownHyperparameter when its mapping sets a field its config does not have."""
    fields = config_fields(kind.config)
    missing = sorted(str(target) for target in kind.hyperparameters.values() if target is not None
                     and target not in fields)
    if missing:
        raise UnknownHyperparameter(f"{kind.config.__name__} has no field {', '.join(missing)}")
    ENGINE_KINDS[name] = kind
    return kind


def config_fields(config: type[RunConfig]) -> set[str]:
    """The field names of a config type."""
    return {f.name for f in dataclasses.fields(config)}


def engine_kind(name: str) -> EngineKind:
    """The engine pieces of a registered kind (KeyError for one this worker does not know)."""
    return ENGINE_KINDS[name]


def load_plugins(modules: Iterable[str]) -> None:
    """Import the job-kind modules (TRAINSERVE_JOB_KIND_MODULES), then the engine module of every kind they added."""
    load_kind_modules(modules)
    for kind in list(KINDS.values()):
        if kind.engine_module is not None:
            importlib.import_module(kind.engine_module)


def engine_module(name: str) -> str | None:
    """The module that registers the engine pieces of kind `name` (None: built in)."""
    return KINDS[name].engine_module if name in KINDS else None


def kind_name(config: RunConfig) -> str:
    """The registered name of a config's kind (the rank processes of a launch look it up by this)."""
    return next(name for name, kind in ENGINE_KINDS.items() if type(config) is kind.config)


def engine_name(task: str, data_format: str) -> str:
    """The entry that runs a job of kind `task` on data of that format: `<task>/<format>` when the kind has one
    (causal-lm/prompts: reinforcement), else `<task>/chat` for chat data when it has one, else the kind's own."""
    own, chat = f"{task}/{data_format}", f"{task}/chat"
    if data_format and own in ENGINE_KINDS:
        return own
    return chat if data_format in CHAT_FORMATS and chat in ENGINE_KINDS else task


def hyperparameter_values(name: str, hyperparameters: BaseModel) -> dict[str, Any]:
    """The config fields entry `name` takes from typed hyperparameters, by its mapping; UnknownHyperparameter for
    a field of the model the mapping does not name (or one it names that the model lacks)."""
    mapping = ENGINE_KINDS[name].hyperparameters
    given = set(type(hyperparameters).model_fields)
    unknown, absent = sorted(given - set(mapping)), sorted(set(mapping) - given)
    if unknown or absent:
        problems = ([f"has no place for hyperparameter {', '.join(unknown)}"] if unknown else []) + (
            [f"expects hyperparameter {', '.join(absent)}"] if absent else [])
        raise UnknownHyperparameter(f"the {name} engine {'; '.join(problems)}")
    return {target: getattr(hyperparameters, field) for field, target in mapping.items() if target is not None}


def build(name: str, common: Mapping[str, Any], row: Any, hyperparameters: BaseModel) -> RunConfig:
    """The frozen config of a run of entry `name` from its typed hyperparameters, its row and `common` (of which
    the config takes those it has); ValueError when two of the parts set the same field."""
    kind = ENGINE_KINDS[name]
    fields = config_fields(kind.config)
    parts = (hyperparameter_values(name, hyperparameters),
             {key: value for key, value in common.items() if key in fields}, dict(kind.from_row(row)))
    values: dict[str, Any] = {}
    for part in parts:
        twice = sorted(set(values) & set(part))
        if twice:
            raise ValueError(f"the {name} config's {', '.join(twice)} set twice")
        values.update(part)
    return kind.config(**values)


def adapter_of(row: Any) -> AdapterConfig | None:
    """The row's adapter settings, typed (None: the job trains every weight)."""
    return AdapterConfig.model_validate(row.adapter) if row.adapter else None


def _chat_fields(row: Any) -> Mapping[str, Any]:
    method = row.method or {}
    return {"base_model": row.base_model_path, "adapter": adapter_of(row),
            "preference": PreferenceConfig.model_validate(method) if method.get("method") == "dpo" else None}


def run_task(config: RunConfig) -> Recipe:
    """The Recipe that runs `config`."""
    return ENGINE_KINDS[kind_name(config)].task(config)


register(TaskKind.TEXT_CLASSIFICATION, EngineKind(
    TrainConfig, ClassifierRecipe,
    {**RUN_HYPERPARAMETERS, **same_names("epochs", "batch_size", "learning_rate", "weight_decay", "max_length",
                                         "seed", "freeze_word_embeddings")},
    lambda row: {"base_model": row.base_model_path, "label_column": row.label_column, "adapter": adapter_of(row)}))
register(TaskKind.CAUSAL_LM, EngineKind(
    LMTrainConfig, CausalLMRecipe,
    {**RUN_HYPERPARAMETERS, **same_names("epochs", "batch_size", "block_size", "learning_rate", "weight_decay",
                                         "seed", "val_fraction")},
    lambda row: {"base_model": row.base_model_path, "model_config": row.model_config_, "adapter": adapter_of(row)}))
# Chat records are rendered whole (up to block_size tokens each) and evaluated only on an eval dataset.
register(f"{TaskKind.CAUSAL_LM}/chat", EngineKind(
    ChatTrainConfig, ChatRecipe,
    {**RUN_HYPERPARAMETERS, **same_names("epochs", "batch_size", "learning_rate", "weight_decay", "seed"),
     "block_size": "max_length", "val_fraction": None},
    _chat_fields))
# Prompts scored by a grader (method reinforcement): GRPO with rollouts from the policy being trained.
register(f"{TaskKind.CAUSAL_LM}/prompts", EngineKind(
    ReinforcementTrainConfig, ReinforcementRecipe,
    {**RUN_HYPERPARAMETERS, **same_names("epochs", "batch_size", "learning_rate", "weight_decay", "seed"),
     "block_size": "max_length", "val_fraction": None},
    lambda row: {"base_model": row.base_model_path, "adapter": adapter_of(row),
                 "reinforcement": ReinforcementConfig.model_validate(row.method)}))
