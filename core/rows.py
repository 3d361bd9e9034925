"""ORM rows. The schema itself is created only by the Alembic migrations; each JSON column is typed (core.columns)."""

from __future__ import annotations

import enum
import re
import uuid
from datetime import UTC, datetime
from typing import Any

from pydantic import JsonValue
from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from core.adapters import AdapterConfig
from core.columns import BestEval, JobError, JSONObject, SweepTemplate, TypedJSON, check_assignments
from core.jobspec import Method, MethodConfig, ModelConfigValue
from core.vocab import (  # the rows' vocabularies, importable from here with the rows that use them
    ACTIVE,
    DEFAULT_TENANT,
    TERMINAL,
    ArtifactKind,
    DeliveryStatus,
    EventKind,
    JobStatus,
    TaskKind,
    WebhookEventType,
)

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

__all__ = ["ACTIVE", "DEFAULT_TENANT", "TERMINAL", "ArtifactKind", "DeliveryStatus", "EventKind", "JobStatus",
           "TaskKind", "WebhookEventType"]  # the vocabularies (core.vocab) that callers import with the rows


def utcnow() -> datetime:
    """Timezone-aware now, the only clock rows use."""
    return datetime.now(UTC)


ID_RE = re.compile(r"^[a-z]{2,8}_[0-9a-f]{24}$")


def is_valid_id(value: str) -> bool:
    """Whether a client-supplied id can name a row at all (checked before it reaches the database)."""
    return bool(ID_RE.match(value))


def new_id(prefix: str) -> str:
    """Opaque ids with a type prefix, e.g. job_3f9c...; unguessable, sortable by nothing."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class UTCDateTime(TypeDecorator[datetime]):
    """Stores aware datetimes; SQLite returns naive ones, which are read back as UTC."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Dataset(Base):
    __tablename__ = "datasets"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True, default=DEFAULT_TENANT,
                                           server_default=DEFAULT_TENANT)
    name: Mapped[str] = mapped_column(String(200))
    filename: Mapped[str] = mapped_column(String(255))
    format: Mapped[str] = mapped_column(String(10))
    rows: Mapped[int] = mapped_column(Integer)
    columns: Mapped[list[str]] = mapped_column(TypedJSON(list[str]))
    column_stats: Mapped[dict[str, Any]] = mapped_column(TypedJSON(dict[str, JSONObject]), default=dict)
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    path: Mapped[str] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    # /v1/files' purpose ("fine-tune" or "batch"); None: uploaded through /datasets (a fine-tune file there).
    purpose: Mapped[str | None] = mapped_column(String(20), nullable=True)


class SweepStatus(enum.StrEnum):
    """A sweep runs until every trial has ended (succeeded) or it is cancelled."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    CANCELLED = "cancelled"


class Sweep(Base):
    """A search over hyperparameters: its trials are fixed at creation, its child jobs are created as slots free."""

    __tablename__ = "sweeps"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16), default=SweepStatus.RUNNING, index=True)
    method: Mapped[str] = mapped_column(String(16))
    parameters: Mapped[dict[str, Any]] = mapped_column(TypedJSON(JSONObject))  # the search space as submitted
    job_spec: Mapped[dict[str, Any]] = mapped_column(TypedJSON(JSONObject))  # the base job as submitted
    template: Mapped[SweepTemplate] = mapped_column(TypedJSON(SweepTemplate))  # validated columns every child shares
    # Per trial: its params and resolved hyperparameters.
    trials: Mapped[list[dict[str, Any]]] = mapped_column(TypedJSON(list[JSONObject]))
    parallelism: Mapped[int] = mapped_column(Integer)
    metric: Mapped[str] = mapped_column(String(64))
    greater_is_better: Mapped[bool] = mapped_column(Boolean)
    pruning: Mapped[dict[str, Any] | None] = mapped_column(TypedJSON(JSONObject), nullable=True)
    best_job_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    children: Mapped[list[Job]] = relationship(back_populates="sweep", order_by="Job.sweep_index")


class Job(Base):
    __tablename__ = "jobs"
    # One child per trial: a second advancer creating the same trial fails on this, never duplicates it.
    __table_args__ = (UniqueConstraint("sweep_id", "sweep_index", name="uq_jobs_sweep_id_sweep_index"),
                      Index("ix_jobs_status_tenant_id", "status", "tenant_id"))  # the scheduler's lookups

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True, default=DEFAULT_TENANT,
                                           server_default=DEFAULT_TENANT)
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED, index=True)
    task: Mapped[str] = mapped_column(String(40))
    base_model: Mapped[str | None] = mapped_column(String(500), nullable=True)
    base_model_path: Mapped[str | None] = mapped_column(String(1000), nullable=True)
    train_dataset_id: Mapped[str | None] = mapped_column(
        ForeignKey("datasets.id", ondelete="SET NULL"), nullable=True
    )
    eval_dataset_id: Mapped[str | None] = mapped_column(
        ForeignKey("datasets.id", ondelete="SET NULL"), nullable=True
    )
    text_column: Mapped[str] = mapped_column(String(200))
    label_column: Mapped[str | None] = mapped_column(String(200), nullable=True)
    # The kind's hyperparameters model as JSON; typed by the row's task when it is resolved (core.jobspec).
    hyperparameters: Mapped[dict[str, Any]] = mapped_column(TypedJSON(JSONObject))
    model_config_: Mapped[dict[str, int] | None] = mapped_column("model_config", TypedJSON(dict[str, ModelConfigValue]),
                                                                  nullable=True)
    adapter: Mapped[AdapterConfig | None] = mapped_column(TypedJSON(AdapterConfig), nullable=True)
    method: Mapped[Method | None] = mapped_column(TypedJSON(MethodConfig), nullable=True)  # the kinds with methods
    metadata_: Mapped[dict[str, str]] = mapped_column("metadata", TypedJSON(dict[str, str]), default=dict)
    suffix: Mapped[str | None] = mapped_column(String(64), nullable=True)  # /v1/fine_tuning/jobs' suffix
    labels: Mapped[list[int | str]] = mapped_column(TypedJSON(list[int | str]), default=list)
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    epoch: Mapped[float] = mapped_column(Float, default=0.0)
    eta_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    metrics: Mapped[dict[str, float]] = mapped_column(TypedJSON(dict[str, float]), default=dict)
    device: Mapped[str | None] = mapped_column(String(40), nullable=True)
    # Devices the job trains on (one DDP process each); a checkpoint resumes only at the same world size.
    devices: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # Hosts the job spans, each with `devices` (worker.jobs.gang): the world size is nodes x devices.
    nodes: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    error: Mapped[JobError | None] = mapped_column(TypedJSON(JobError), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    task_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    cancel_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # Scheduling: higher priority first within a tenant; claimed_at and run_seconds measure device time.
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    claimed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    run_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    receipt: Mapped[dict[str, Any] | None] = mapped_column(TypedJSON(JSONObject), nullable=True)
    rerun_of: Mapped[str | None] = mapped_column(String(40), nullable=True)
    best: Mapped[BestEval | None] = mapped_column(TypedJSON(BestEval), nullable=True)
    stop_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    sweep_id: Mapped[str | None] = mapped_column(ForeignKey("sweeps.id", ondelete="SET NULL"), nullable=True,
                                                 index=True)
    sweep_index: Mapped[int | None] = mapped_column(Integer, nullable=True)

    sweep: Mapped[Sweep | None] = relationship(back_populates="children")
    artifacts: Mapped[list[Artifact]] = relationship(
        back_populates="job", order_by="Artifact.created_at", cascade="all, delete-orphan"
    )

    @property
    def is_terminal(self) -> bool:
        """True once the job can no longer change status."""
        return self.status in TERMINAL


class MetricPoint(Base):
    __tablename__ = "metric_points"
    __table_args__ = (UniqueConstraint("job_id", "name", "step", name="uq_metric_points_job_name_step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(64))
    value: Mapped[float] = mapped_column(Float)
    epoch: Mapped[float] = mapped_column(Float, default=0.0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(40))
    level: Mapped[str] = mapped_column(String(10), default="info")
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(TypedJSON(JSONObject), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Artifact(Base):
    __tablename__ = "artifacts"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(20))
    path: Mapped[str] = mapped_column(String(1000))
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    files: Mapped[list[str]] = mapped_column(TypedJSON(list[str]), default=list)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    job: Mapped[Job] = relationship(back_populates="artifacts")


class OutboxMessage(Base):
    """A task message written in the transaction of the state change that needs it; a relay sends it."""

    __tablename__ = "outbox"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    task: Mapped[str] = mapped_column(String(100))
    queue: Mapped[str] = mapped_column(String(40))
    args: Mapped[list[Any]] = mapped_column(TypedJSON(list[JsonValue]))
    # Message headers (the request id, so the worker's log lines for the job carry it); None on older rows.
    headers: Mapped[dict[str, str] | None] = mapped_column(TypedJSON(dict[str, str]), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    sent_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)


class ApiKey(Base):
    """A bearer key; only its SHA-256 is stored. The tenant owns what the key creates."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class IdempotencyRecord(Base):
    """The first result of a POST made with an Idempotency-Key, per tenant and route."""

    __tablename__ = "idempotency_records"
    __table_args__ = (UniqueConstraint("tenant_id", "route", "key", name="uq_idempotency_records_tenant_route_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    route: Mapped[str] = mapped_column(String(100))
    key: Mapped[str] = mapped_column(String(255))
    request_hash: Mapped[str] = mapped_column(String(64))
    resource_id: Mapped[str] = mapped_column(String(40))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class WebhookEndpoint(Base):
    """A tenant's URL and the event types it receives; deliveries are signed with its secret."""

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    url: Mapped[str] = mapped_column(String(2000))
    description: Mapped[str] = mapped_column(String(200), default="")
    event_types: Mapped[list[str]] = mapped_column(TypedJSON(list[str]))
    secret: Mapped[str] = mapped_column(String(100))
    # After a rotation the old secret signs too, until previous_secret_until (receivers switch over meanwhile).
    previous_secret: Mapped[str | None] = mapped_column(String(100), nullable=True)
    previous_secret_until: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class WebhookEvent(Base):
    """One state change worth telling endpoints about; its id is the webhook-id of every delivery of it."""

    __tablename__ = "webhook_events"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    type: Mapped[str] = mapped_column(String(40))
    payload: Mapped[str] = mapped_column(Text)  # the exact signed body, so every redelivery is byte-identical
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)


class WebhookDelivery(Base):
    """An event on its way to one endpoint: written with the event, retried with backoff by the sender."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_status_next", "status", "next_attempt_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(ForeignKey("webhook_events.id", ondelete="CASCADE"), index=True)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), index=True)
    status: Mapped[str] = mapped_column(String(16), default=DeliveryStatus.PENDING)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    event: Mapped[WebhookEvent] = relationship()
    attempt_log: Mapped[list[WebhookAttempt]] = relationship(order_by="WebhookAttempt.id",
                                                             cascade="all, delete-orphan")


class WebhookAttempt(Base):
    """One HTTP try of a delivery: what the endpoint answered, or why nothing came back."""

    __tablename__ = "webhook_attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    delivery_id: Mapped[int] = mapped_column(ForeignKey("webhook_deliveries.id", ondelete="CASCADE"), index=True)
    attempted_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    duration_ms: Mapped[float] = mapped_column(Float)
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    response_body: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)


class Batch(Base):
    """OpenAI's /v1/batches: a file of requests run by the generation workers (core.batches tells its lifecycle)."""

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16))
    endpoint: Mapped[str] = mapped_column(String(40))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(8))
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", TypedJSON(JSONObject), nullable=True)
    output_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    # Batch-level: why it failed.
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(TypedJSON(list[JSONObject]), nullable=True)
    total: Mapped[int] = mapped_column(Integer)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    lines_done: Mapped[int] = mapped_column(Integer, default=0)  # lines whose results are durably stored
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)  # its runner is alive
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class Eval(Base):
    """OpenAI's /v1/evals: what an item looks like (a JSON schema) and how a model's answer to it is graded."""

    __tablename__ = "evals"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(256))
    data_source_config: Mapped[dict[str, Any]] = mapped_column(TypedJSON(JSONObject))
    # Graders (core.graders.spec).
    testing_criteria: Mapped[list[dict[str, Any]]] = mapped_column(TypedJSON(list[JSONObject]))
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", TypedJSON(JSONObject), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)


class EvalRun(Base):
    """One run of an eval against a model: its samples come from a batch; its grades are EvalOutputItem rows."""

    __tablename__ = "eval_runs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    eval_id: Mapped[str] = mapped_column(String(40), ForeignKey("evals.id", ondelete="CASCADE"), index=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(256))
    model: Mapped[str] = mapped_column(String(200))
    data_source: Mapped[dict[str, Any]] = mapped_column(TypedJSON(JSONObject))
    total: Mapped[int] = mapped_column(Integer)
    batch_id: Mapped[str | None] = mapped_column(String(40), nullable=True, index=True)
    # A fine-tuning job's eval: `base` runs on its base model when it is created, `fine_tuned` on it once it succeeds.
    job_id: Mapped[str | None] = mapped_column(String(40), ForeignKey("jobs.id", ondelete="CASCADE"), nullable=True,
                                               index=True)
    role: Mapped[str | None] = mapped_column(String(16), nullable=True)
    status: Mapped[str] = mapped_column(String(16))  # queued until its batch exists; then read from the batch
    error: Mapped[dict[str, Any] | None] = mapped_column(TypedJSON(JSONObject), nullable=True)
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", TypedJSON(JSONObject), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    # Its output items counted as they are stored, in their transaction (core.store.evals.count_items).
    passed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    failed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    errored: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # {criterion name: {"passed": n, "failed": n}} and {model: {"invocation_count": n, "prompt_tokens": n, ...}}
    criteria_counts: Mapped[dict[str, Any]] = mapped_column(TypedJSON(dict[str, dict[str, int]]), default=dict,
                                                            server_default="{}")
    model_usage: Mapped[dict[str, Any]] = mapped_column(TypedJSON(dict[str, dict[str, int]]), default=dict,
                                                        server_default="{}")


class EvalOutputItem(Base):
    """One item of a run, graded once: (run, item index) is unique, so a resumed run never grades it again."""

    __tablename__ = "eval_output_items"
    __table_args__ = (UniqueConstraint("run_id", "datasource_item_id", name="uq_eval_output_items_run_item"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(40), ForeignKey("eval_runs.id", ondelete="CASCADE"), index=True)
    eval_id: Mapped[str] = mapped_column(String(40))
    datasource_item_id: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(8))  # pass, fail, error
    sample: Mapped[dict[str, Any]] = mapped_column(TypedJSON(JSONObject))
    results: Mapped[list[dict[str, Any]]] = mapped_column(TypedJSON(list[JSONObject]))  # one per testing criterion
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
    gate: Mapped[dict[str, Any] | None] = mapped_column(TypedJSON(JSONObject), nullable=True)
    moved_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)


class StoredResponse(Base):
    """A /v1/responses answer kept for retrieval and for `previous_response_id` chains, until it expires.

    `context` is the conversation the model saw before this request's own input (the chain's earlier inputs and
    outputs, as Responses items); `input_items` is this request's input, `body` the Response object as answered.
    """

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    model: Mapped[str] = mapped_column(String(200))
    previous_response_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    context: Mapped[list[dict[str, Any]]] = mapped_column(TypedJSON(list[JSONObject]))
    input_items: Mapped[list[dict[str, Any]]] = mapped_column(TypedJSON(list[JSONObject]))
    body: Mapped[dict[str, Any]] = mapped_column(TypedJSON(JSONObject))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)


check_assignments(Base)  # a typed JSON attribute refuses a value its type does not take when it is assigned
