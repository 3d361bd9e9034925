"""The engine's frozen config, built from a job row and its datasets (fetched from the artifact store)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from core.hyperparams import greater_is_better
from core.rows import Job, TaskKind
from core.paths import job_checkpoints_dir, job_model_dir
from core.protocol import ErrorCode
from core.settings import Settings
from core.storage import ArtifactStore
from core.store import datasets as dataset_store
from worker.engines.lm_training import LMTrainConfig
from worker.engines.training import TrainConfig

EngineConfig = TrainConfig | LMTrainConfig


def build_config(settings: Settings, job: Job, train_path: Path, eval_path: Path | None, hashes: dict[str, str],
                 device: str) -> EngineConfig:
    """The engine's frozen config from a job row."""
    hp = job.hyperparameters
    common: dict[str, Any] = {
        "train_file": train_path, "eval_file": eval_path, "output_dir": job_model_dir(settings, job.id),
        "checkpoint_dir": job_checkpoints_dir(settings, job.id), "text_column": job.text_column,
        "epochs": hp["epochs"], "max_steps": hp["max_steps"], "batch_size": hp["batch_size"],
        "learning_rate": hp["learning_rate"], "warmup_ratio": hp["warmup_ratio"],
        "weight_decay": hp["weight_decay"], "gradient_accumulation_steps": hp["gradient_accumulation_steps"],
        "precision": hp["precision"], "seed": hp["seed"], "eval_steps": hp["eval_steps"],
        "checkpoint_steps": settings.checkpoint_steps, "device": device, "devices": job.devices,
        "memory_limit_bytes": settings.worker_memory_bytes or None,
        "base_model_name": job.base_model or "", "dataset_hashes": hashes, **best_fields(job.task, hp)}
    if job.task == TaskKind.CAUSAL_LM:
        return LMTrainConfig(**common, base_model=job.base_model_path, model_config=job.model_config_,
                             val_fraction=hp["val_fraction"], block_size=hp["block_size"])
    assert job.base_model_path is not None and job.label_column is not None
    return TrainConfig(**common, base_model=job.base_model_path, label_column=job.label_column,
                       max_length=hp["max_length"],
                       freeze_word_embeddings=hp.get("freeze_word_embeddings", False))  # absent on older jobs


def best_fields(task: str, hp: dict[str, Any]) -> dict[str, Any]:
    """Best-checkpoint and early-stopping settings (jobs from before them have none: their last model is kept)."""
    metric = hp.get("metric_for_best")
    if metric is None:
        return {}
    return {"metric_for_best": metric, "greater_is_better": greater_is_better(task, metric),
            "early_stopping_patience": hp.get("early_stopping_patience"),
            "early_stopping_threshold": hp.get("early_stopping_threshold", 0.0)}



class DatasetMissing(ValueError):
    """A job's dataset row or its stored file is gone."""

    code = ErrorCode.DATASET_MISSING


@dataclass(frozen=True)
class JobInputs:
    """The stored datasets a job trains on: their storage keys and content hashes."""

    train: str
    eval: str | None
    hashes: dict[str, str]


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
    return JobInputs(train=train_ds.path, eval=eval_key, hashes=hashes)


def config_for(settings: Settings, storage: ArtifactStore, job: Job, inputs: JobInputs, device: str) -> EngineConfig:
    """Fetch the datasets (cached on this host) and build the job's config; DatasetMissing if one is not stored."""
    try:
        train_path = storage.fetch_file(inputs.train)
        eval_path = storage.fetch_file(inputs.eval) if inputs.eval is not None else None
    except FileNotFoundError as exc:
        raise DatasetMissing(str(exc)) from exc
    return build_config(settings, job, train_path, eval_path, inputs.hashes, device)
