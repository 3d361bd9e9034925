"""A job row resolved into what the engines take (`ResolvedJob`), and the engine's frozen config built from it and
its datasets (fetched from the artifact store)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from core.jobspec import ResolvedJob, stored_hyperparameters
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


def resolve_job(job: Job) -> ResolvedJob:
    """The row as the engines take it: typed, its hyperparameters validated back into its kind's model
    (ValidationFailed naming a stored key the model refuses)."""
    return ResolvedJob(id=job.id, kind=job.task, hyperparameters=stored_hyperparameters(job.task, job.hyperparameters),
                       text_column=job.text_column, devices=job.devices, nodes=job.nodes, base_model=job.base_model,
                       base_model_path=job.base_model_path, model_config=job.model_config_,
                       label_column=job.label_column, adapter=job.adapter, method=job.method)


def build_config(settings: Settings, job: ResolvedJob, train_path: Path, eval_path: Path | None,
                 hashes: dict[str, str], device: str, data_format: str = "") -> EngineConfig:
    """The engine's frozen config of a resolved job; the training data's format picks the kind's entry (chat data:
    kinds.engine_name)."""
    common: dict[str, Any] = {
        "train_file": train_path, "eval_file": eval_path, "output_dir": job_model_dir(settings, job.id),
        "checkpoint_dir": job_checkpoints_dir(settings, job.id), "checkpoint_steps": settings.checkpoint_steps,
        "device": device, "memory_limit_bytes": settings.worker_memory_bytes or None, "dataset_hashes": hashes}
    return kinds.build(kinds.engine_name(job.kind, data_format), common, job)


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


def config_for(settings: Settings, storage: ArtifactStore, job: ResolvedJob, inputs: JobInputs,
               device: str) -> EngineConfig:
    """Fetch the datasets (cached on this host) and build the job's config; DatasetMissing if one is not stored."""
    try:
        train_path = storage.fetch_file(inputs.train)
        eval_path = storage.fetch_file(inputs.eval) if inputs.eval is not None else None
    except FileNotFoundError as exc:
        raise DatasetMissing(str(exc)) from exc
    if job.base_model_path is not None and is_job_model(job.base_model_path):  # continue from a finished job's model
        job = dataclasses.replace(job, base_model_path=str(fetch_full_model(storage, job.base_model_path)))
    return build_config(settings, job, train_path, eval_path, inputs.hashes, device, inputs.train_format)
