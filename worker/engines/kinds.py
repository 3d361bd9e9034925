"""The engine side of the job-kind registry (core.jobspec holds the rest): kind -> frozen config type, Recipe.

`build(kind, common, job, hp)` makes a kind's config: every field the config shares with the kind's
hyperparameters model comes from the model (so a new hyperparameter is one field in each), the rest from
`common` (paths, device, settings: those the config has) and the kind's `from_row` (what its row resolved: base
model, labels, adapter, method).

A kind may train differently on chat data (core.chat_data's formats): its entry `<kind>/chat`
(`engine_name`) then runs those jobs, e.g. causal-lm over chat, completion or preference records is chat SFT or
DPO (worker.engines.chat_training), over a text corpus next-token training (worker.engines.lm_training).
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
from core.vocab import TaskKind
from worker.engines.chat_training import ChatRecipe, ChatTrainConfig
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
    """The entry that runs a job of kind `task` on data of that format: `<task>/chat` for chat data when the
    kind has one, else the kind's own."""
    chat = f"{task}/chat"
    return chat if data_format in CHAT_FORMATS and chat in ENGINE_KINDS else task


def build(name: str, common: Mapping[str, Any], row: Any, hyperparameters: BaseModel) -> RunConfig:
    """The frozen config of a run of entry `name` from its typed hyperparameters, its row and `common`."""
    kind = ENGINE_KINDS[name]
    names = {f.name for f in dataclasses.fields(kind.config)}
    values = {**hyperparameters.model_dump(), **common, **kind.from_row(row)}
    return kind.config(**{key: value for key, value in values.items() if key in names})


def adapter_of(row: Any) -> AdapterConfig | None:
    """The row's adapter settings, typed (None: the job trains every weight)."""
    return AdapterConfig.model_validate(row.adapter) if row.adapter else None


def _chat_fields(row: Any) -> Mapping[str, Any]:
    method = row.method or {}
    block = (row.hyperparameters or {}).get("block_size")
    return {"base_model": row.base_model_path, "adapter": adapter_of(row),
            "preference": PreferenceConfig.model_validate(method) if method.get("method") == "dpo" else None,
            **({"max_length": block} if block else {})}


def run_task(config: RunConfig) -> Recipe:
    """The Recipe that runs `config`."""
    return ENGINE_KINDS[kind_name(config)].task(config)


register(TaskKind.TEXT_CLASSIFICATION, EngineKind(
    TrainConfig, ClassifierRecipe,
    lambda row: {"base_model": row.base_model_path, "label_column": row.label_column, "adapter": adapter_of(row)}))
register(TaskKind.CAUSAL_LM, EngineKind(
    LMTrainConfig, CausalLMRecipe,
    lambda row: {"base_model": row.base_model_path, "model_config": row.model_config_, "adapter": adapter_of(row)}))
register(f"{TaskKind.CAUSAL_LM}/chat", EngineKind(ChatTrainConfig, ChatRecipe, _chat_fields))
