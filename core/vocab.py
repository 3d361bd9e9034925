"""The vocabularies of the rows' columns: job statuses, job kinds, artifact and event kinds, webhook event types
and delivery statuses (string enums, stored as their values)."""

from __future__ import annotations

import enum


class JobStatus(enum.StrEnum):
    """Lifecycle of a job; the last three are terminal."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class TaskKind(enum.StrEnum):
    """The built-in kinds of job (what a job trains); core.jobspec registers each, keyed by its value."""

    TEXT_CLASSIFICATION = "text-classification"
    CAUSAL_LM = "causal-lm"


class ArtifactKind(enum.StrEnum):
    """What an artifact row holds."""

    MODEL = "model"  # the job's final save_pretrained folder with its manifest
    CHECKPOINT = "checkpoint"  # a resumable training state (the best and the latest are kept)
    TENSORBOARD = "tensorboard"  # the run's TensorBoard event files


class EventKind(enum.StrEnum):
    """The kinds of a job's events (GET /jobs/{id}/events): its moves between statuses, named by the status it
    reached unless a move names itself, and what the worker and the engine report while it runs."""

    CREATED = "created"
    CLAIMED = "claimed"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"  # also the engine's own word when it stops for a cancel
    CANCEL_REQUESTED = "cancel_requested"
    PREEMPTED = "preempted"  # back to the queue: the worker shut down
    REQUEUED = "requeued"  # back to the queue: the reaper found its worker silent
    STARTED = "started"
    EVAL = "eval"
    EVAL_RUN = "eval_run"  # an eval run named by the job (on its base, or on it) has graded every item
    CHECKPOINT = "checkpoint"
    CHECKPOINT_NOT_STORED = "checkpoint_not_stored"
    RESUMED = "resumed"
    BEST_RESTORED = "best_restored"
    SAVED = "saved"
    OOM = "oom"  # the engine halved its micro-batches after running out of memory
    EARLY_STOPPING = "early_stopping"  # a run ended early, as completed: its eval metric stopped improving
    PRUNED = "pruned"  # a run ended early, as completed: its sweep's pruning rule stopped it


ACTIVE = frozenset({JobStatus.QUEUED, JobStatus.RUNNING})

DEFAULT_TENANT = "default"

TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})


class WebhookEventType(enum.StrEnum):
    """What a webhook endpoint can subscribe to."""

    JOB_QUEUED = "job.queued"
    JOB_STARTED = "job.started"
    JOB_CHECKPOINT = "job.checkpoint"
    JOB_SUCCEEDED = "job.succeeded"
    JOB_FAILED = "job.failed"
    JOB_CANCELLED = "job.cancelled"
    SWEEP_FINISHED = "sweep.finished"
    MODEL_ALIAS_MOVED = "model_alias.moved"


class DeliveryStatus(enum.StrEnum):
    """A webhook delivery: pending (retrying) until delivered or given up (failed)."""

    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"
