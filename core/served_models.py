"""Causal LMs that /generate can serve: <home>/models/<name>, finished causal-lm jobs, hub ids when online.

A job's model is named to the worker by its job id: the worker fetches it from the artifact store. How a LoRA adapter
job reaches the generation engine is decided here, once (`adapter_served_per_row`): over a llama-family base, per
row (the worker loads the base once and batches its adapters' rows with the base's); over any other base, whole (the
artifact's merged/ copy when training wrote one, else the base with the adapter folded in once per host:
worker.model_store.fetch_full_model).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.architectures import LLAMA_FAMILY, unsupported_reason
from core.errors import NotFound, ValidationFailed
from core.estimate import load_model_config
from core.pretrained import HUB_ID, hub_model_available
from core.rows import Job, JobStatus, TaskKind, is_valid_id
from core.settings import Settings
from core.store.aliases import find_alias, is_alias_name
from core.store.owned import get_owned

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


@dataclass(frozen=True)
class ServedModel:
    """A model name clients use and where the worker loads it from."""

    id: str
    path: str  # a folder on the worker's host, a hub id, or a job id (fetched from the artifact store)
    owned_by: str
    created: int
    adapter: str | None = None  # a LoRA adapter job's id, served over `path` (its base model)
    context: int | None = None  # tokens the model attends to (its config's positions); None when unknown here


def context_of(config: dict | None) -> int | None:
    """The context length a model's config.json declares (the engine serves exactly that many positions)."""
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = (config or {}).get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _is_causal_lm(folder: Path) -> bool:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    architectures = config.get("architectures") or []
    has_weights = any(folder.glob("*.safetensors"))
    return has_weights and (any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in architectures)
                            or config.get("model_type") == "gpt2")


def check_servable(name: str, config: dict | None) -> None:
    """Refuse (422 naming `model`) a model whose config.json names an architecture the engine does not run.

    A config that cannot be read here (a hub model not cached yet) passes: the worker refuses it when loading.
    """
    reason = unsupported_reason(config) if config is not None else None
    if reason is not None:
        raise ValidationFailed("model", f"model {name!r}: {reason}")


def _job_config(job: Job) -> dict | None:
    """The config.json that a causal-lm job's model shares with its base (a GPT-2 when built from model_config)."""
    if job.base_model_path is None:
        return {"model_type": "gpt2"}
    return load_model_config(job.base_model_path)


def is_job_model(path: str) -> bool:
    """Whether a ServedModel path names a trained job rather than a folder or a hub id."""
    return path.startswith("job_") and is_valid_id(path)


def local_models(settings: Settings) -> list[ServedModel]:
    """Folders under <home>/models holding a causal LM in Hugging Face format with safetensors weights."""
    root = settings.home / "models"
    if not root.is_dir():
        return []
    return [ServedModel(id=p.name, path=str(p.resolve()), owned_by="local", created=int(p.stat().st_mtime))
            for p in sorted(root.iterdir()) if p.is_dir() and NAME_RE.match(p.name) and _is_causal_lm(p)]


def job_models(session: Session, *, tenant: str | None) -> list[Job]:
    """Succeeded causal-lm jobs visible to the tenant."""
    query = select(Job).where(Job.task == TaskKind.CAUSAL_LM, Job.status == JobStatus.SUCCEEDED)
    if tenant is not None:
        query = query.where(Job.tenant_id == tenant)
    return list(session.scalars(query.order_by(Job.created_at)))


def list_served_models(session: Session, settings: Settings, *, tenant: str | None) -> list[ServedModel]:
    """Everything the caller can generate with (hub models are not enumerated)."""
    jobs = job_models(session, tenant=tenant)
    # Each base's config.json read once per listing, however many adapter jobs share that base.
    bases = {job.base_model_path for job in jobs if job.adapter is not None and job.base_model_path is not None}
    configs = {base: load_model_config(base) for base in bases}
    return local_models(settings) + [_job_model(job, configs.get(job.base_model_path or "")) for job in jobs]


def adapter_served_per_row(config: dict | None) -> bool:
    """Whether an adapter over a base of this config is applied per row by the generation engine's batched LoRA
    (llama-family bases) rather than served whole, its merged model loaded like any full model."""
    return config is not None and config.get("model_type") in LLAMA_FAMILY


def _job_model(job: Job, config: dict | None) -> ServedModel:
    """A finished causal-lm job as a served model, named by its job id: its own model, or its adapter over its base
    (per row), or its adapter merged (whole): `config` is the base's config.json."""
    created = int(job.created_at.timestamp())
    if job.adapter is not None and job.base_model_path is not None:
        if adapter_served_per_row(config):
            return ServedModel(id=job.id, path=job.base_model_path, owned_by=job.tenant_id, created=created,
                               adapter=job.id)
    return ServedModel(id=job.id, path=job.id, owned_by=job.tenant_id, created=created)


def resolve_served_model(session: Session, settings: Settings, *, name: str, tenant: str | None) -> ServedModel:
    """Find the model called `name` (an alias: its target, so the target's per-model bounds hold for both) or raise
    NotFound naming `model`."""
    if is_alias_name(name):
        alias = find_alias(session, name=name, tenant=tenant)
        return resolve_served_model(session, settings, name=alias.target, tenant=alias.tenant_id)
    if name.startswith("job_"):
        job = get_owned(session, Job, name, what="model", tenant=tenant, field="model")
        if job.task != TaskKind.CAUSAL_LM or job.status != JobStatus.SUCCEEDED:
            raise NotFound(f"job {name!r} is not a finished causal-lm job", field="model")
        config = _job_config(job)
        check_servable(name, config)
        context = context_of(job.model_config_) if job.base_model_path is None else context_of(config)
        return dataclasses.replace(_job_model(job, config), context=context)
    if NAME_RE.match(name):
        folder = settings.home / "models" / name  # NAME_RE admits no separators, so this stays under models/
        if folder.is_dir() and _is_causal_lm(folder):
            config = load_model_config(str(folder))
            check_servable(name, config)
            return ServedModel(id=name, path=str(folder.resolve()), owned_by="local",
                               created=int(folder.stat().st_mtime), context=context_of(config))
    if "/" in name and HUB_ID.match(name) and hub_model_available(name, max_bytes=settings.max_model_bytes):
        config = load_model_config(name)
        check_servable(name, config)
        return ServedModel(id=name, path=name, owned_by="hub", created=0, context=context_of(config))
    raise NotFound(f"model {name!r} not found; GET /v1/models lists what can be served", field="model")
