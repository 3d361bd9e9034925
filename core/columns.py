"""Typed JSON columns: each JSON column of core.rows names its pydantic type, checked where it is written and read.

`TypedJSON(T)` stores what `TypeAdapter(T)` dumps as JSON, so a column typed by the model a service used to
`model_dump` into it stores the same JSON as before (no migration), and reads it back validated into T. A value the
type refuses fails where it is written: when it is assigned to the attribute (`check_assignments`), when it is
bound (a Core UPDATE sets no attribute) and, for a row stored by older code, when it is read. Each column's
`Mapped[...]` annotation is the same T, so mypy checks the code on both sides of the database.
"""

from __future__ import annotations

from typing import Any

from pydantic import JsonValue, TypeAdapter
from sqlalchemy import JSON, event
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.types import TypeDecorator
from typing_extensions import TypedDict  # pydantic validates only this one on Python < 3.12

from core.adapters import AdapterConfig
from core.jobspec import MethodConfig, ModelConfigValue

JSONObject = dict[str, JsonValue]  # a column holding any JSON object (what a client submitted, a data source)


class JobError(TypedDict):
    """Why a job failed: the one error envelope's body (core.protocol.ErrorBody) as its `error` column keeps it."""

    code: str
    message: str
    field: str | None


class BestEval(TypedDict):
    """The evaluation whose weights became the job's model: its step, metric_for_best and that metric's value."""

    step: int
    metric: str
    value: float


class SweepTemplate(TypedDict, total=False):
    """The validated columns every child job of a sweep shares (app.services.sweeps.sweep_template), typed as on `Job`;
    each key optional, as a sweep stored before a column was added lacks it."""

    task: str
    base_model: str | None
    base_model_path: str | None
    train_dataset_id: str | None
    eval_dataset_id: str | None
    text_column: str
    label_column: str | None
    labels: list[int | str]
    model_config_: dict[str, ModelConfigValue] | None
    metadata_: dict[str, str]
    devices: int
    nodes: int
    adapter: AdapterConfig | None
    method: MethodConfig | None


class TypedJSON(TypeDecorator[Any]):
    """A JSON column whose values are validated by `TypeAdapter(model)` on assignment, on bind and on read."""

    impl = JSON
    cache_ok = True
    # As JSON does (none_as_null=False): None is stored as JSON null, as the untyped columns stored it.
    should_evaluate_none = True

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model  # part of the statement cache key, so hashable (a type)
        self._adapter: TypeAdapter[Any] = TypeAdapter(model)

    def validate(self, value: Any) -> Any:
        """The value as the column's type (None stays None); pydantic's ValidationError when it is not one."""
        return None if value is None else self._adapter.validate_python(value)

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        return None if value is None else self._adapter.dump_python(self.validate(value), mode="json")

    def process_result_value(self, value: Any, dialect: Any) -> Any:
        return self.validate(value)

    def on_set(self, target: Any, value: Any, old: Any, initiator: Any) -> Any:
        """Attribute `set` listener: the assigned value, validated into the column's type."""
        return self.validate(value)


def typed_columns(base: type[DeclarativeBase]) -> dict[str, TypedJSON]:
    """Every typed JSON column of the mapped classes, by `Class.attribute`."""
    return {f"{mapper.class_.__name__}.{key}": column.type for mapper in base.registry.mappers
            for key, column in mapper.columns.items() if isinstance(column.type, TypedJSON)}


def check_assignments(base: type[DeclarativeBase]) -> None:
    """Validate each value assigned to a typed JSON attribute when it is assigned (the constructor's too)."""
    for mapper in base.registry.mappers:
        for key, column in mapper.columns.items():
            if isinstance(column.type, TypedJSON):
                event.listen(getattr(mapper.class_, key), "set", column.type.on_set, retval=True)
