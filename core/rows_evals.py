"""The eval and model-alias tables: evals, their runs and graded output items; aliases and their moves."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from core.rows import Base, UTCDateTime, utcnow


class Eval(Base):
    """OpenAI's /v1/evals: what an item looks like (a JSON schema) and how a model's answer to it is graded."""

    __tablename__ = "evals"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(256))
    data_source_config: Mapped[dict[str, Any]] = mapped_column(JSON)
    testing_criteria: Mapped[list[dict[str, Any]]] = mapped_column(JSON)  # graders (core.graders.spec)
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)


class EvalRun(Base):
    """One run of an eval against a model: its samples come from a batch; its grades are EvalOutputItem rows."""

    __tablename__ = "eval_runs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    eval_id: Mapped[str] = mapped_column(String(40), ForeignKey("evals.id", ondelete="CASCADE"), index=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(256))
    model: Mapped[str] = mapped_column(String(200))
    data_source: Mapped[dict[str, Any]] = mapped_column(JSON)
    total: Mapped[int] = mapped_column(Integer)
    batch_id: Mapped[str | None] = mapped_column(String(40), nullable=True, index=True)
    # A fine-tuning job's eval: `base` runs on its base model when it is created, `fine_tuned` on it once it succeeds.
    job_id: Mapped[str | None] = mapped_column(String(40), ForeignKey("jobs.id", ondelete="CASCADE"), nullable=True,
                                               index=True)
    role: Mapped[str | None] = mapped_column(String(16), nullable=True)
    status: Mapped[str] = mapped_column(String(16))  # queued until its batch exists; then read from the batch
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)


class EvalOutputItem(Base):
    """One item of a run, graded once: (run, item index) is unique, so a resumed run never grades it again."""

    __tablename__ = "eval_output_items"
    __table_args__ = (UniqueConstraint("run_id", "datasource_item_id", name="uq_eval_output_items_run_item"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(40), ForeignKey("eval_runs.id", ondelete="CASCADE"), index=True)
    eval_id: Mapped[str] = mapped_column(String(40))
    datasource_item_id: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(8))  # pass, fail, error
    sample: Mapped[dict[str, Any]] = mapped_column(JSON)
    results: Mapped[list[dict[str, Any]]] = mapped_column(JSON)  # one per testing criterion
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ModelAlias(Base):
    """A tenant's name for a served model (`support-bot:production`): every generation route serves its target."""

    __tablename__ = "model_aliases"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_model_aliases_tenant_name"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(130))
    target: Mapped[str] = mapped_column(String(200))  # a served model name: a local model, a job id, a hub id
    gate_eval_id: Mapped[str | None] = mapped_column(String(40), nullable=True)  # moves must beat it on this eval
    description: Mapped[str | None] = mapped_column(String(500), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ModelAliasMove(Base):
    """One move of an alias (its creation too): who, when, from, to, and the gate's verdict when there was one."""

    __tablename__ = "model_alias_moves"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    alias_id: Mapped[str] = mapped_column(String(40), ForeignKey("model_aliases.id", ondelete="CASCADE"), index=True)
    from_target: Mapped[str | None] = mapped_column(String(200), nullable=True)
    to_target: Mapped[str] = mapped_column(String(200))
    moved_by: Mapped[str] = mapped_column(String(40))  # the API key's id
    gate: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    moved_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
