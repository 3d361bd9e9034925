"""Every JSON column is typed (core.columns.TypedJSON): a value its type refuses is refused where it is written (on
assignment, and on bind for a Core UPDATE that assigns nothing), a stored row reads back as the model, and the JSON
stored is the JSON the untyped columns stored (no migration)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from sqlalchemy import JSON, Column, MetaData, String, Table, select, text, update
from sqlalchemy.exc import StatementError

from core.adapters import AdapterConfig, PreferenceConfig
from core.columns import TypedJSON, typed_columns
from core.reinforcement import ReinforcementConfig
from core.rows import Base, Job, new_id


def _job(**columns):
    values = {"id": new_id("job"), "task": "causal-lm", "text_column": "text", "hyperparameters": {"epochs": 1.0}}
    return Job(**{**values, **columns})


def test_every_json_column_is_typed():
    untyped = [f"{table.name}.{column.name}" for table in Base.metadata.tables.values() for column in table.columns
               if isinstance(column.type, JSON)]
    assert untyped == []
    assert {"Job.adapter", "Job.method", "Job.error", "Job.best", "Job.metrics", "Job.model_config_"} <= set(
        typed_columns(Base))


def test_a_value_the_column_type_refuses_is_refused_when_assigned():
    with pytest.raises(ValidationError, match="r"):
        _job(adapter={"r": 0})  # the constructor assigns too
    job = _job()
    for column, bad in (("metrics", {"eval_loss": "low"}), ("error", {"code": "oom"}),  # no message
                        ("best", {"step": 3, "metric": "eval_loss"}), ("model_config_", {"n_layer": 2**40}),
                        ("method", {"method": "ppo"}), ("labels", [{"a": 1}]), ("metadata_", {"k": 1}),
                        ("hyperparameters", {"epochs": {1, 2}})):
        with pytest.raises(ValidationError):
            setattr(job, column, bad)
    job.adapter = {"r": 4}  # a dict the type takes becomes the model
    assert job.adapter == AdapterConfig(r=4)


def test_a_stored_row_reads_back_as_the_model_and_stores_the_json_it_always_did(factory):
    grader = {"type": "string_check", "name": "g", "input": "{{sample.output_text}}", "reference": "1",
              "operation": "eq"}
    method = ReinforcementConfig.model_validate({"grader": grader})
    with factory() as session:
        job = _job(adapter=AdapterConfig(r=4), method=method, model_config_={"n_layer": 2}, labels=[0, "b"],
                   metrics={"eval_loss": 0.5}, best={"step": 2, "metric": "eval_loss", "value": 0.5},
                   error={"code": "oom", "message": "out of memory", "field": None})
        session.add(job)
        session.commit()
        job_id = job.id
    with factory() as session:
        stored = session.get(Job, job_id)
        assert stored is not None
        assert stored.adapter == AdapterConfig(r=4) and isinstance(stored.method, ReinforcementConfig)
        assert stored.method == method and stored.labels == [0, "b"] and stored.best == {
            "step": 2, "metric": "eval_loss", "value": 0.5}
        raw = session.execute(text("SELECT adapter::text, method::text FROM jobs WHERE id = :id"),
                              {"id": job_id}).one()
    # What admission stored as model_dump(mode="json") before the columns were typed.
    assert json.loads(raw[0]) == AdapterConfig(r=4).model_dump(mode="json")
    assert json.loads(raw[1]) == method.model_dump(mode="json")


def test_none_is_stored_as_the_untyped_column_stored_it(factory):
    """JSON null, as sa.JSON(none_as_null=False) writes None: a query on IS NULL sees what it saw before."""
    legacy = Table("jobs", MetaData(), Column("id", String), Column("adapter", JSON))
    with factory() as session:
        inserted, updated, untyped = _job(adapter=None), _job(adapter=AdapterConfig()), _job(adapter=AdapterConfig())
        session.add_all([inserted, updated, untyped])
        session.flush()
        updated.adapter = None
        session.flush()
        session.execute(update(legacy).where(legacy.c.id == untyped.id).values(adapter=None))
        rows = dict(session.execute(text("SELECT id, adapter::text FROM jobs")).tuples().all())
        session.rollback()
    assert rows[inserted.id] == rows[updated.id] == rows[untyped.id] == "null"


def test_a_core_update_is_checked_when_bound_and_a_bad_stored_value_when_read(factory):
    with factory() as session:
        job = _job(method=PreferenceConfig())
        session.add(job)
        session.commit()
        with pytest.raises(StatementError, match="validation error"):
            session.execute(update(Job).where(Job.id == job.id).values(best={"step": "last"}))
        session.rollback()
        # A row written around the types (by hand, or by older code) fails when it is read, naming the column's type.
        session.execute(text("UPDATE jobs SET adapter = CAST(:bad AS json) WHERE id = :id"),
                        {"bad": '{"r": 0}', "id": job.id})
        with pytest.raises(ValidationError, match="AdapterConfig"):
            session.execute(select(Job.adapter).where(Job.id == job.id)).scalar_one()
        session.rollback()


def test_the_column_type_is_part_of_the_statement_cache_key():
    assert TypedJSON(AdapterConfig)._static_cache_key == TypedJSON(AdapterConfig)._static_cache_key
    assert TypedJSON(AdapterConfig)._static_cache_key != TypedJSON(PreferenceConfig)._static_cache_key
