"""The engine's frozen config, built from a job row and its datasets (fetched from the artifact store)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from core.hyperparams import TrainingHyperparameters
from core.jobspec import kind_of, stored_hyperparameters
from core.paths import job_checkpoints_dir, job_model_dir
from core.protocol import ErrorCode
from core.rows import Job
from core.served_models import is_job_model
from core.settings import Settings
from core.storage import ArtifactStore
from core.store import datasets as dataset_store
from worker.engines.training import kinds
from worker.engines.training.loop import RunConfig
from worker.model_store import fetch_full_model

EngineConfig = RunConfig  # each kind's frozen config (worker.engines.training.kinds)


def build_config(settings: Settings, job: Job, train_path: Path, eval_path: Path | None, hashes: dict[str, str],
                 device: str, data_format: str = "") -> EngineConfig:
    """The engine's frozen config from a job row: its kind's typed hyperparameters, rebuilt from the row; the
    training data's format picks the kind's entry (chat data: kinds.engine_name)."""
    hp = stored_hyperparameters(job.task, job.hyperparameters)
    common: dict[str, Any] = {
        "train_file": train_path, "eval_file": eval_path, "output_dir": job_model_dir(settings, job.id),
        "checkpoint_dir": job_checkpoints_dir(settings, job.id), "text_column": job.text_column,
        "checkpoint_steps": settings.checkpoint_steps, "device": device, "devices": job.devices,
        "memory_limit_bytes": settings.worker_memory_bytes or None,
        "base_model_name": job.base_model or "", "dataset_hashes": hashes, **best_fields(job.task, hp)}
    return kinds.build(kinds.engine_name(job.task, data_format), common, job, hp)


def best_fields(task: str, hp: TrainingHyperparameters) -> dict[str, Any]:
    """Best-checkpoint settings: the metric and its direction, or none for a row from before them (its last model
    is kept)."""
    if "metric_for_best" not in hp.model_fields_set:
        return {"metric_for_best": None}
    return {"metric_for_best": hp.metric_for_best,
            "greater_is_better": kind_of(task).greater_is_better(hp.metric_for_best)}


class DatasetMissing(ValueError):
    """A job's dataset row or its stored file is gone."""

    code = ErrorCode.DATASET_MISSING


@dataclass(frozen=True)
class JobInputs:
    """The stored datasets a job trains on: their storage keys and content hashes."""

    train: str
    eval: str | None
    hashes: dict[str, str]
    train_format: str = ""  # the dataset's format (csv, jsonl, txt, or a chat format: core.chat_data)


def job_inputs(session: Session, job: Job) -> JobInputs:
    """Read the job's dataset rows; DatasetMissing when the training dataset was deleted."""
    if job.train_dataset_id is None:
        raise DatasetMissing("the training dataset was deleted")
    train_ds = dataset_store.get_dataset(session, dataset_id=job.train_dataset_id)
    hashes = {"train": train_ds.sha256}
    eval_key = None
    if job.eval_dataset_id is not None:
        eval_ds = dataset_store.get_dataset(session, dataset_id=job.eval_dataset_id)
        eval_key = eval_ds.path
        hashes["eval"] = eval_ds.sha256
    return JobInputs(train=train_ds.path, eval=eval_key, hashes=hashes, train_format=train_ds.format)


def config_for(settings: Settings, storage: ArtifactStore, job: Job, inputs: JobInputs, device: str) -> EngineConfig:
    """Fetch the datasets (cached on this host) and build the job's config; DatasetMissing if one is not stored."""
    try:
        train_path = storage.fetch_file(inputs.train)
        eval_path = storage.fetch_file(inputs.eval) if inputs.eval is not None else None
    except FileNotFoundError as exc:
        raise DatasetMissing(str(exc)) from exc
    config = build_config(settings, job, train_path, eval_path, inputs.hashes, device, inputs.train_format)
    base = getattr(config, "base_model", None)
    if isinstance(base, str) and is_job_model(base):  # continue from a finished job's model
        continued: dict[str, Any] = {"base_model": str(fetch_full_model(storage, base))}  # a field of the kind's config
        config = dataclasses.replace(config, **continued)
    return config
