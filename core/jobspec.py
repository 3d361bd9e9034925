"""One typed job spec from request to engine, and the one registry of job kinds.

A POST /jobs body is a union discriminated by `task` (a body without it is a text-classification job, as
it always was); each kind is a `JobSpec` subclass whose `hyperparameters` is that kind's typed model
(core.hyperparams: the one place of their ranges and defaults). The row stores the hyperparameters' JSON and the
adapter and method as their models (core.columns); the worker resolves the row into a `ResolvedJob` (the kind's
hyperparameters model rebuilt by `stored_hyperparameters`), the one thing the engines take.

`KINDS` is the registry, and a `JobKind` is the one declaration of a kind: its spec model, eval metrics (and which
way each is better: the metric_for_best choices), held-out eval, and, by dotted name (`module:attribute`, as the
API may not import the worker nor the worker the API), its admission checks (a function of app.services.job_kinds'
`KindChecks` shape) and its engine entries (worker.engines.training.kinds.EngineKind objects): the one for its
own data and one per data format it trains differently (`variants`: "chat" for any chat format, or a format of
core.chat_data such as "prompts"). Each side resolves its own parts and checks at start-up that every kind has
them (app.services.job_kinds.check_kinds, worker.engines.training.kinds.check_kinds); nothing else is
registered anywhere. `RegisteredKind` is a request field naming a kind (the fine-tuning route's `task`). A kind
shipped outside this package lives in a module named by TRAINSERVE_JOB_KIND_MODULES, which the API imports when it
builds its app and every worker when it starts (`load_kind_modules`). The request body (`JobCreate`) validates
against the kinds registered when a request arrives, and the OpenAPI document lists those registered when it is
built.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

from core.adapters import AdapterConfig, PreferenceConfig, SupervisedConfig
from core.chat_data import CHAT_FORMATS
from core.errors import ValidationFailed
from core.hyperparams import Hyperparameters, LMHyperparameters, TrainingHyperparameters
from core.reinforcement import ReinforcementConfig
from core.schema_bounds import nesting_depth
from core.tasks import MAX_JOB_DEVICES, MAX_JOB_NODES
from core.vocab import TaskKind

INT32_MAX = 2**31 - 1  # steps, event ids and model_config values are 32-bit integer columns or smaller
ModelConfigValue = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]
DEFAULT_KIND = TaskKind.TEXT_CLASSIFICATION  # the kind of a body that names none
MAX_NESTING = 16  # deeper JSON in hyperparameters cannot be a valid value; refused before it is validated
CHAT_VARIANT = "chat"  # a kind's engine variant for any chat format without one of its own
Method = SupervisedConfig | PreferenceConfig | ReinforcementConfig  # how a kind with methods trains
MethodConfig = Annotated[Method, Field(discriminator="method")]  # the same, validated by its `method` tag


class JobSpec(BaseModel):
    """What every training request carries; each kind narrows `task` and types `hyperparameters`.

    Unknown fields are rejected so typos do not pass silently.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    task: str
    base_model: str | None = Field(
        None, min_length=1, max_length=500,
        description="text-classification: alias (minilm-l6), local folder or hub id (required). "
                    "causal-lm: an existing causal LM to continue from, or omit and give model_config.")
    architecture: dict[str, ModelConfigValue] | None = Field(
        None, alias="model_config",
        description="causal-lm from scratch: GPT-2 shape {n_layer, n_embd, n_head, n_positions}.")
    train_dataset: str = Field(min_length=1, max_length=40)
    eval_dataset: str | None = Field(None, min_length=1, max_length=40)
    text_column: str = Field("text", min_length=1, max_length=200)
    label_column: str | None = Field(None, min_length=1, max_length=200,
                                     description="text-classification only (default 'label').")
    hyperparameters: TrainingHyperparameters
    devices: int = Field(
        1, ge=1, le=MAX_JOB_DEVICES,
        description="Devices to train on per node (one process each) on a worker that owns at least this many; "
                    "hyperparameters keep their meaning: batch_size is split across all nodes x devices.")
    nodes: int = Field(
        1, ge=1, le=MAX_JOB_NODES,
        description="Hosts to train on: this many workers (each owning `devices`) join one rendezvous; the run's "
                    "world size is nodes x devices.")
    metadata: dict[str, str] = Field(default_factory=dict, description="Up to 16 string pairs for your own use.")
    priority: int = Field(0, ge=-100, le=100, description="Higher runs first among your team's queued jobs.")

    @field_validator("hyperparameters", mode="before")
    @classmethod
    def _bounded_nesting(cls, value: Any) -> Any:
        if nesting_depth(value) > MAX_NESTING:
            raise ValueError(f"nested more than {MAX_NESTING} levels deep")
        return value

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > 16:
            raise ValueError("at most 16 keys")
        for key, item in value.items():
            if len(key) > 64 or len(item) > 512:
                raise ValueError("keys are at most 64 characters and values at most 512")
            if "\x00" in key or "\x00" in item:
                raise ValueError("NUL characters are not allowed")
        return value

    def request(self) -> dict[str, Any]:
        """The request as the client sent it (hyperparameters it gave, every other field resolved), as JSON."""
        body = self.model_dump(mode="json", by_alias=True)
        body["hyperparameters"] = self.hyperparameters.model_dump(mode="json", exclude_unset=True)
        return body


class ClassificationJob(JobSpec):
    """Fine-tune a pretrained encoder with a classification head on labelled texts."""

    task: Literal[TaskKind.TEXT_CLASSIFICATION] = TaskKind.TEXT_CLASSIFICATION
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)
    adapter: AdapterConfig | None = Field(
        None, description="LoRA: train a low-rank adapter (and the new head) on the frozen base, not all weights.")


class CausalLMJob(JobSpec):
    """Train a fresh GPT-2 (model_config) or continue a causal LM (base_model) on a text corpus, or fine-tune
    base_model on chat data (SFT: loss on assistant turns), preference pairs (DPO) or prompts scored by a grader
    (reinforcement: GRPO)."""

    task: Literal[TaskKind.CAUSAL_LM]
    hyperparameters: LMHyperparameters = Field(default_factory=LMHyperparameters)
    adapter: AdapterConfig | None = Field(
        None, description="LoRA: train a low-rank adapter on the frozen base_model instead of all its weights.")
    method: MethodConfig = Field(
        default_factory=SupervisedConfig,
        description="sft (default): next-token loss on a text corpus, or on the assistant turns of a chat or "
                    "completion dataset; dpo: preference pairs, needs an adapter and a base_model; reinforcement: "
                    "GRPO on a prompts dataset, rewarded by a grader.")


def task_name(spec: type[JobSpec]) -> str:
    """The kind a spec model stands for: its `task` literal."""
    (value,) = get_args(spec.model_fields["task"].annotation)
    return str(value)


@dataclass(frozen=True)
class JobKind:
    """The one declaration of a kind of job: what every layer knows of it, and where each side finds its own part."""

    spec: type[JobSpec]
    metrics: Mapping[str, bool]  # the eval metrics it reports -> whether greater is better (metric_for_best)
    admission: str  # `module:function`: its admission checks (app.services.job_kinds.KindChecks), run by the API
    engine: str  # `module:attribute`: the EngineKind that trains it (worker.engines.training.kinds), on workers
    # Data format -> `module:attribute` of the EngineKind that trains it on that data instead ("chat": any chat
    # format without its own); a kind with variants also takes chat datasets (core.chat_data).
    variants: Mapping[str, str] = dataclasses.field(default_factory=dict)
    holds_out_eval: bool = False  # without an eval_dataset it evaluates on a share of the training data
    quantizes_base: bool = False  # its engines load a base in 4-bit for an adapter that asks (adapter.quantize_base)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.variants) - {CHAT_VARIANT, *CHAT_FORMATS})
        if unknown:
            raise ValueError(f"{self.name}: variants are keyed by {CHAT_VARIANT!r} or a chat format "
                             f"({', '.join(CHAT_FORMATS)}), not {', '.join(map(repr, unknown))}")
        for ref in (self.admission, self.engine, *self.variants.values()):
            split_ref(ref)

    @property
    def name(self) -> str:
        return task_name(self.spec)

    @property
    def chat_data(self) -> bool:
        """It also trains on chat, completion, preference or prompts datasets (core.chat_data): it has variants."""
        return bool(self.variants)

    @property
    def engines(self) -> dict[str, str]:
        """Its engine entries: entry name (the kind's, or `<kind>/<format>`) -> `module:attribute`."""
        return {self.name: self.engine, **{f"{self.name}/{key}": ref for key, ref in self.variants.items()}}

    @property
    def hyperparameters(self) -> type[TrainingHyperparameters]:
        annotation = self.spec.model_fields["hyperparameters"].annotation
        assert isinstance(annotation, type) and issubclass(annotation, TrainingHyperparameters)
        return annotation

    @property
    def methods(self) -> tuple[str, ...]:
        """The training methods its spec's `method` field takes (sft, dpo); none for a kind without the field."""
        field = self.spec.model_fields.get("method")
        if field is None:
            return ()
        members = get_args(field.annotation) or (field.annotation,)
        return tuple(str(value) for member in members for value in get_args(member.model_fields["method"].annotation))

    def greater_is_better(self, metric: str) -> bool:
        """Direction of one of its eval metrics (KeyError for a metric it does not report)."""
        return self.metrics[metric]


def split_ref(ref: str) -> tuple[str, str]:
    """(module, attribute) of a `module:attribute` reference; ValueError for one of another shape."""
    module, colon, attribute = ref.partition(":")
    if not (module and colon and attribute.isidentifier()):
        raise ValueError(f"{ref!r} is not a `module:attribute` reference")
    return module, attribute


def resolve_ref(ref: str) -> Any:
    """The object a `module:attribute` reference names (importing its module); ImportError or AttributeError when
    it names none."""
    module, attribute = split_ref(ref)
    return getattr(importlib.import_module(module), attribute)


KINDS: dict[str, JobKind] = {}
_adapter: TypeAdapter[JobSpec] | None = None


def register(kind: JobKind) -> JobKind:
    """Add a job kind (its name is its spec's `task` literal); the request union is rebuilt with it."""
    global _adapter
    KINDS[kind.name] = kind
    _adapter = None
    return kind


def unregister(name: str) -> None:
    """Remove a job kind (tests that add their own)."""
    global _adapter
    KINDS.pop(name, None)
    _adapter = None


def kind_of(name: str) -> JobKind:
    """The registered kind of that name (KeyError for one this version does not know)."""
    return KINDS[name]


def kinds_where(predicate: Callable[[JobKind], bool]) -> str:
    """The names of the registered kinds a predicate holds for, for a message ('causal-lm or ...')."""
    return " or ".join(name for name, kind in KINDS.items() if predicate(kind))


def _known_kind(value: str) -> str:
    if value not in KINDS:
        raise PydanticCustomError("literal_error", "Input should be {expected}",
                                  {"expected": " or ".join(repr(name) for name in KINDS)})
    return value


class RegisteredKind:
    """A kind's name as a request field (`Annotated[str, RegisteredKind]`): checked against the kinds registered
    when the request arrives (the error an unknown Literal gives), listed as the kinds registered when the OpenAPI
    document is built."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_after_validator_function(_known_kind, core_schema.str_schema())

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {"type": "string", "enum": list(KINDS)}


def _tag(value: Any) -> str | None:
    task = value.get("task", DEFAULT_KIND) if isinstance(value, dict) else getattr(value, "task", None)
    return str(task) if isinstance(task, str) else None


def spec_union() -> Any:
    """The request body type: the registered kinds' specs, discriminated by `task` (absent: text-classification)."""
    members = tuple(Annotated[kind.spec, Tag(name)] for name, kind in KINDS.items())
    # An unknown kind reads as the enum error it always was; `field` names the member app/errors.py reports.
    expected = " or ".join(repr(name) for name in KINDS)
    return Annotated[Union[members],  # noqa: UP007 - a runtime tuple of members needs Union[...]
                     Discriminator(_tag, custom_error_type="literal_error",
                                   custom_error_context={"expected": expected, "field": "task"})]


def _spec_adapter() -> TypeAdapter[JobSpec]:
    global _adapter
    if _adapter is None:
        _adapter = TypeAdapter(spec_union())
    return _adapter


def parse_spec(data: Any) -> JobSpec:
    """Validate a request body (or a stored one) into its kind's spec; pydantic's ValidationError if invalid."""
    return _spec_adapter().validate_python(data)


def load_kind_modules(modules: Iterable[str]) -> None:
    """Import each module (TRAINSERVE_JOB_KIND_MODULES) so it registers its kinds; ImportError names a missing one."""
    for name in modules:
        importlib.import_module(name)


class RegisteredSpec:
    """The request body type (`JobCreate`): a body is validated by `parse_spec`, so against the kinds registered
    when it arrives (plugin modules load after this module), with the same error locations as the union; its
    JSON schema is the union of the kinds registered when the OpenAPI document is built."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_plain_validator_function(parse_spec)

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return handler(_spec_adapter().core_schema)


def field_of(loc: tuple[Any, ...], ctx: Any = None) -> str | None:
    """The dotted field a validation error names: its location without kind tags (union members), plus the
    member a discriminator names (`ctx.field`, an unknown `task`)."""
    parts = [str(p) for p in loc if p not in KINDS]
    if isinstance(ctx, dict) and isinstance(ctx.get("field"), str):
        parts.append(ctx["field"])
    return ".".join(parts) or None


def _failed(exc: ValidationError, *prefix: str) -> ValidationFailed:
    error = exc.errors()[0]
    field = field_of((*prefix, *error["loc"]), error.get("ctx"))
    return ValidationFailed(field, f"{field}: {error['msg']}" if field else error["msg"])


def validate_spec(data: Any) -> JobSpec:
    """parse_spec for bodies built on the server (a sweep's trial, a rerun): ValidationFailed naming the field."""
    try:
        return parse_spec(data)
    except ValidationError as exc:
        raise _failed(exc) from exc


def stored_hyperparameters(task: str, stored: Mapping[str, Any]) -> TrainingHyperparameters:
    """Rebuild a job's typed hyperparameters from its row, validated by its kind's model (fields a row predates get
    their defaults; `model_fields_set` tells which the row had); ValidationFailed naming a key the model does not
    take or a value it refuses."""
    try:
        return kind_of(task).hyperparameters.model_validate(dict(stored))
    except ValidationError as exc:
        raise _failed(exc, "hyperparameters") from exc


@dataclass(frozen=True, kw_only=True)
class ResolvedJob:
    """A stored job as the engines take it: the columns they read, typed, with the kind's hyperparameters model
    (worker.jobs.config.resolve_job builds it from the row). Never the ORM row, so a renamed column fails mypy
    where the row is read, not a run."""

    id: str
    kind: str
    hyperparameters: TrainingHyperparameters  # the kind's own model (KINDS[kind].hyperparameters)
    text_column: str
    devices: int  # per node
    nodes: int
    base_model: str | None  # the name the client gave; None: a fresh model
    base_model_path: str | None  # where the worker loads it from (admission resolved the name)
    model_config: Mapping[str, int] | None  # a fresh causal LM's shape
    label_column: str | None
    adapter: AdapterConfig | None
    method: Method | None  # the kinds with methods (JobKind.methods)


register(JobKind(ClassificationJob, {"eval_loss": False, "eval_accuracy": True, "eval_f1": True},
                  admission="app.services.job_kinds:classification_fields",
                  engine="worker.engines.training.kinds:CLASSIFICATION"))
register(JobKind(CausalLMJob, {"eval_loss": False, "perplexity": False, "eval_reward": True},
                  admission="app.services.job_kinds:causal_lm_fields",
                  engine="worker.engines.training.kinds:CAUSAL_LM",
                  variants={CHAT_VARIANT: "worker.engines.training.kinds:CHAT",
                            "prompts": "worker.engines.training.kinds:REINFORCEMENT"},
                  holds_out_eval=True, quantizes_base=True))
if TYPE_CHECKING:
    JobCreate = JobSpec
else:
    JobCreate = RegisteredSpec  # the API's request body (and a sweep's base job)
