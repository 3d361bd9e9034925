"""The engine's frozen config, built from a job row and its datasets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from core.models import Job, TaskKind
from core.paths import from_home, job_checkpoints_dir, job_model_dir
from core.settings import Settings
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
        "base_model_name": job.base_model or "", "dataset_hashes": hashes}
    if job.task == TaskKind.CAUSAL_LM:
        return LMTrainConfig(**common, base_model=job.base_model_path, model_config=job.model_config_,
                             val_fraction=hp["val_fraction"], block_size=hp["block_size"])
    assert job.base_model_path is not None and job.label_column is not None
    return TrainConfig(**common, base_model=job.base_model_path, label_column=job.label_column,
                       max_length=hp["max_length"],
                       freeze_word_embeddings=hp.get("freeze_word_embeddings", False))  # absent on older jobs


def config_for(settings: Settings, session: Session, job: Job, device: str) -> EngineConfig:
    """Resolve the job's datasets and build its config; ValueError when the training dataset is gone."""
    if job.train_dataset_id is None:
        raise ValueError("the training dataset was deleted")
    train_ds = dataset_store.get_dataset(session, dataset_id=job.train_dataset_id)
    hashes = {"train": train_ds.sha256}
    eval_path = None
    if job.eval_dataset_id is not None:
        eval_ds = dataset_store.get_dataset(session, dataset_id=job.eval_dataset_id)
        eval_path = from_home(settings, eval_ds.path)
        hashes["eval"] = eval_ds.sha256
    return build_config(settings, job, from_home(settings, train_ds.path), eval_path, hashes, device)
