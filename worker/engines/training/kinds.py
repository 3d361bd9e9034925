"""The engine side of the job-kind registry: each entry's frozen config type, Recipe, and how a config is built.

A kind's one declaration (core.jobspec.JobKind) names its engine entries by `module:attribute`; each is an
`EngineKind` defined in the module that runs it (the built-in ones below, a plugin's in its own module), resolved
here (`engine_kind`) and checked when a worker starts (`check_kinds`): every registered kind has an EngineKind for
itself and each of its data-format variants, each mapping its kind's hyperparameters model field for field, and
no two entries share a config type (a multi-device launch finds its entry by it).

`build(name, common, job)` makes an entry's config from three disjoint parts: the job's typed hyperparameters
through the entry's one explicit `hyperparameters` mapping (each field of the kind's model -> the config field it
sets, or None where another part carries it), `common` (paths, device, settings, and the job's own columns every
config has: those the config has) and the entry's `from_job` (what the resolved job carries for this engine: base
model, labels, adapter, method). A hyperparameter the mapping does not name is an error, never dropped; the
configs take every value from the model, so its defaults are the only ones. Engines take a `ResolvedJob`
(core.jobspec), never the ORM row.

A kind may train differently on chat data (core.chat_data's formats): its variant `<kind>/chat`
(`engine_name`) then runs those jobs, e.g. causal-lm over chat, completion or preference records is chat SFT or
DPO (worker.engines.training.chat), over prompts GRPO (worker.engines.training.reinforcement), over a text corpus
next-token training (worker.engines.training.causal_lm).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from core.adapters import PreferenceConfig
from core.chat_data import CHAT_FORMATS
from core.hyperparams import TrainingHyperparameters
from core.jobspec import CHAT_VARIANT, KINDS, JobKind, ResolvedJob, kind_of, resolve_ref
from core.reinforcement import ReinforcementConfig
from worker.engines.training.causal_lm import CausalLMRecipe, LMTrainConfig
from worker.engines.training.chat import ChatRecipe, ChatTrainConfig
from worker.engines.training.classifier import ClassifierRecipe, TrainConfig
from worker.engines.training.loop import Recipe, RunConfig
from worker.engines.training.reinforcement import ReinforcementRecipe, ReinforcementTrainConfig

# What every kind's hyperparameters share (TrainingHyperparameters) -> RunConfig's fields; metric_for_best is
# None: `best_fields` resolves it with its direction (or none, for a row from before it).
RUN_HYPERPARAMETERS: Mapping[str, str | None] = {
    "max_steps": "max_steps", "warmup_ratio": "warmup_ratio",
    "gradient_accumulation_steps": "gradient_accumulation_steps", "precision": "precision",
    "eval_steps": "eval_steps", "metric_for_best": None, "early_stopping_patience": "early_stopping_patience",
    "early_stopping_threshold": "early_stopping_threshold", "gradient_checkpointing": "gradient_checkpointing",
    "offload_activations": "offload_activations", "sharding": "sharding"}


class UnknownHyperparameter(ValueError):
    """A hyperparameter the kind's engine mapping does not name (or a mapping that names a missing field)."""


def same_names(*names: str) -> dict[str, str]:
    """Mapping entries for hyperparameters whose config field has the same name."""
    return {name: name for name in names}


@dataclass(frozen=True)
class EngineKind:
    """One engine entry of a job kind: how the engines run it; UnknownHyperparameter when its mapping sets a field
    its config does not have."""

    config: type[RunConfig]
    task: Callable[[Any], Recipe]  # config -> the loop's Recipe
    # Every field of the kind's hyperparameters model -> the config field it sets (None: not the config's).
    hyperparameters: Mapping[str, str | None]
    # The resolved job -> the config fields this engine takes from it (base_model, label_column, adapter, ...).
    from_job: Callable[[ResolvedJob], Mapping[str, Any]] = lambda job: {}

    def __post_init__(self) -> None:
        fields = config_fields(self.config)
        missing = sorted(str(target) for target in self.hyperparameters.values() if target is not None
                         and target not in fields)
        if missing:
            raise UnknownHyperparameter(f"{self.config.__name__} has no field {', '.join(missing)}")


class IncompleteKind(LookupError):
    """A registered job kind whose engine entries this worker cannot resolve, or that do not fit the kind."""


def config_fields(config: type[RunConfig]) -> set[str]:
    """The field names of a config type."""
    return {f.name for f in dataclasses.fields(config)}


def engine_ref(name: str) -> str:
    """The `module:attribute` of entry `name` (a kind's, or `<kind>/<format>`); KeyError for one no kind declares."""
    task = name.partition("/")[0]
    return KINDS[task].engines[name]


def engine_kind(name: str) -> EngineKind:
    """The engine pieces of entry `name`, resolved from its kind's declaration; IncompleteKind when its reference
    names no EngineKind."""
    return resolve_engine(engine_ref(name))


def resolve_engine(ref: str) -> EngineKind:
    """The EngineKind a `module:attribute` reference names (a rank process of a launch resolves it by this alone)."""
    try:
        engine = resolve_ref(ref)
    except (ImportError, AttributeError) as exc:
        raise IncompleteKind(f"{ref} names no engine: {exc}") from exc
    if not isinstance(engine, EngineKind):
        raise IncompleteKind(f"{ref} is a {type(engine).__name__}, not an EngineKind")
    return engine


def kind_problems(kind: JobKind) -> list[str]:
    """What keeps this worker from running every entry of `kind` (empty when it can)."""
    found: list[str] = []
    fields = set(kind.hyperparameters.model_fields)
    for name, ref in kind.engines.items():
        try:
            engine = resolve_engine(ref)
        except IncompleteKind as exc:
            found.append(f"{name}: {exc}")
            continue
        unknown, absent = sorted(fields - set(engine.hyperparameters)), sorted(set(engine.hyperparameters) - fields)
        if unknown or absent:
            found.append(f"{name}: its mapping misses {', '.join(unknown) or '-'} and names "
                         f"{', '.join(absent) or '-'}, against {kind.hyperparameters.__name__}")
    return found


def check_kinds() -> None:
    """Every registered kind has a resolvable EngineKind for itself and each variant, each mapping its
    hyperparameters model exactly, and no two entries share a config type; IncompleteKind naming each gap."""
    found = [problem for kind in KINDS.values() for problem in kind_problems(kind)]
    by_config: dict[type[RunConfig], list[str]] = {}
    for kind in KINDS.values():
        for name, ref in kind.engines.items():
            if not any(problem.startswith(f"{name}:") for problem in found):
                by_config.setdefault(resolve_engine(ref).config, []).append(name)
    found += [f"{', '.join(names)} share the config {config.__name__}" for config, names in by_config.items()
              if len(names) > 1]
    if found:
        raise IncompleteKind("job kinds this worker cannot run: " + "; ".join(found))


def entry_of(config: RunConfig) -> str:
    """The entry whose config type `config` is (the one that runs it)."""
    return next(name for kind in KINDS.values() for name, ref in kind.engines.items()
                if type(config) is resolve_engine(ref).config)


def engine_name(task: str, data_format: str) -> str:
    """The entry that runs a job of kind `task` on data of that format: `<task>/<format>` when the kind has one
    (causal-lm/prompts: reinforcement), else `<task>/chat` for chat data when it has one, else the kind's own."""
    variants = KINDS[task].variants
    if data_format and data_format in variants:
        return f"{task}/{data_format}"
    return f"{task}/{CHAT_VARIANT}" if data_format in CHAT_FORMATS and CHAT_VARIANT in variants else task


def hyperparameter_values(name: str, hyperparameters: BaseModel) -> dict[str, Any]:
    """The config fields entry `name` takes from typed hyperparameters, by its mapping; UnknownHyperparameter for
    a field of the model the mapping does not name (or one it names that the model lacks)."""
    mapping = engine_kind(name).hyperparameters
    given = set(type(hyperparameters).model_fields)
    unknown, absent = sorted(given - set(mapping)), sorted(set(mapping) - given)
    if unknown or absent:
        problems = ([f"has no place for hyperparameter {', '.join(unknown)}"] if unknown else []) + (
            [f"expects hyperparameter {', '.join(absent)}"] if absent else [])
        raise UnknownHyperparameter(f"the {name} engine {'; '.join(problems)}")
    return {target: getattr(hyperparameters, field) for field, target in mapping.items() if target is not None}


def build(name: str, common: Mapping[str, Any], job: ResolvedJob) -> RunConfig:
    """The frozen config of a run of entry `name` from the job's typed hyperparameters, the job itself and `common`
    (of which the config takes those it has); ValueError when two of the parts set the same field."""
    kind = engine_kind(name)
    fields = config_fields(kind.config)
    shared = {"text_column": job.text_column, "devices": job.devices, "nodes": job.nodes,
              "base_model_name": job.base_model or "",
              **best_fields(job.kind, job.hyperparameters), **common}
    parts = (hyperparameter_values(name, job.hyperparameters),
             {key: value for key, value in shared.items() if key in fields}, dict(kind.from_job(job)))
    values: dict[str, Any] = {}
    for part in parts:
        twice = sorted(set(values) & set(part))
        if twice:
            raise ValueError(f"the {name} config's {', '.join(twice)} set twice")
        values.update(part)
    return kind.config(**values)


def best_fields(task: str, hp: TrainingHyperparameters) -> dict[str, Any]:
    """Best-checkpoint settings: the metric and its direction, or none for a row from before them (its last model
    is kept)."""
    if "metric_for_best" not in hp.model_fields_set:
        return {"metric_for_best": None}
    return {"metric_for_best": hp.metric_for_best,
            "greater_is_better": kind_of(task).greater_is_better(hp.metric_for_best)}


def _reinforcement(job: ResolvedJob) -> ReinforcementConfig:
    if not isinstance(job.method, ReinforcementConfig):
        raise ValueError(f"a prompts dataset trains with method reinforcement; job {job.id} has {job.method!r}")
    return job.method


def run_task(config: RunConfig) -> Recipe:
    """The Recipe that runs `config`."""
    return engine_kind(entry_of(config)).task(config)


CLASSIFICATION = EngineKind(
    TrainConfig, ClassifierRecipe,
    {**RUN_HYPERPARAMETERS, **same_names("epochs", "batch_size", "learning_rate", "weight_decay", "max_length",
                                         "seed", "freeze_word_embeddings")},
    lambda job: {"base_model": job.base_model_path, "label_column": job.label_column, "adapter": job.adapter})
CAUSAL_LM = EngineKind(
    LMTrainConfig, CausalLMRecipe,
    {**RUN_HYPERPARAMETERS, **same_names("epochs", "batch_size", "block_size", "learning_rate", "weight_decay",
                                         "seed", "val_fraction")},
    lambda job: {"base_model": job.base_model_path, "model_config": job.model_config, "adapter": job.adapter})
# Chat records are rendered whole (up to block_size tokens each) and evaluated only on an eval dataset.
CHAT = EngineKind(
    ChatTrainConfig, ChatRecipe,
    {**RUN_HYPERPARAMETERS, **same_names("epochs", "batch_size", "learning_rate", "weight_decay", "seed"),
     "block_size": "max_length", "val_fraction": None},
    lambda job: {"base_model": job.base_model_path, "adapter": job.adapter,
                 "preference": job.method if isinstance(job.method, PreferenceConfig) else None})
# Prompts scored by a grader (method reinforcement): GRPO with rollouts from the policy being trained.
REINFORCEMENT = EngineKind(
    ReinforcementTrainConfig, ReinforcementRecipe,
    {**RUN_HYPERPARAMETERS, **same_names("epochs", "batch_size", "learning_rate", "weight_decay", "seed"),
     "block_size": "max_length", "val_fraction": None},
    lambda job: {"base_model": job.base_model_path, "adapter": job.adapter, "reinforcement": _reinforcement(job)})
