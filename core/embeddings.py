"""/v1/embeddings and /classify apart from HTTP and torch: the wire messages (API -> inference worker) and which
models embed.

A model is named by the client as one of:
- a built-in alias of a sentence-transformers model shipped as a package (`minilm-l6`);
- a folder under <home>/models holding a sentence-transformers model (its `modules.json`);
- the id of a succeeded text-classification job: its fine-tuned encoder, mean-pooled and L2-normalised.

The reference sent to the worker is the alias, the job id, or the folder: the worker resolves an alias in its own
installation (the API image installs the package without torch, in another place) and fetches a job's model from
the artifact store.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, field_validator, model_validator
from sqlalchemy.orm import Session

from core.errors import NotFound, ValidationFailed
from core.protocol import ErrorBody
from core.rows import Job, JobStatus, TaskKind
from core.settings import Settings
from core.store.aliases import find_alias, is_alias_name
from core.store.owned import get_owned

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
MODULES = "modules.json"


class ClassifyTask(BaseModel):
    """The broker message for one /classify call (API -> inference worker)."""

    request_id: str
    job_id: str
    texts: list[str]
    deadline: float  # wall-clock time after which the caller has stopped waiting
    tenant: str = ""  # whose request: the worker shares its model over tenants (worker/servers/fair_turns.py)

    @field_validator("texts")
    @classmethod
    def _some(cls, texts: list[str]) -> list[str]:
        if not texts:
            raise ValueError("texts is empty")
        return texts


class Prediction(BaseModel):
    """One text's label and probability."""

    label: Any
    score: float


class ClassifyResult(BaseModel):
    """The inference worker's reply: predictions in input order, or an error."""

    predictions: list[Prediction] | None = None
    error: ErrorBody | None = None


class EmbedTask(BaseModel):
    """The broker message for one /v1/embeddings call (API -> inference worker): texts or token ids, not both."""

    request_id: str
    model: str  # a built-in alias, a job id, or an absolute model folder (see the module doc)
    texts: list[str] | None = None
    token_ids: list[list[int]] | None = None  # the model's own vocabulary; special tokens are added by the worker
    dimensions: int | None = None
    deadline: float  # wall-clock time after which the caller has stopped waiting
    tenant: str = ""  # whose request: the worker shares its model over tenants (worker/servers/fair_turns.py)

    @model_validator(mode="after")
    def _one_input(self) -> EmbedTask:
        if (self.texts is None) == (self.token_ids is None):
            raise ValueError("exactly one of texts and token_ids")
        if not (self.texts or self.token_ids):
            raise ValueError("no inputs")
        return self


class EmbedResult(BaseModel):
    """The worker's reply: one little-endian float32 vector per input, base64-encoded, in input order; or an error."""

    embeddings: list[str] | None = None
    dimensions: int = 0
    prompt_tokens: int = 0
    error: ErrorBody | None = None

    @field_validator("dimensions", "prompt_tokens")
    @classmethod
    def _not_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be >= 0")
        return value


def is_sentence_transformer(folder: Path) -> bool:
    """A folder sentence-transformers can load: a `modules.json` beside a model's config."""
    return (folder / MODULES).is_file()


def resolve_embedding_model(session: Session, settings: Settings, *, name: str, tenant: str | None,
                            aliases: dict[str, Path]) -> str:
    """The reference the worker loads for `name` (see the module doc), or NotFound/ValidationFailed naming `model`.

    `aliases` are core.pretrained.builtin_aliases() (a parameter so that tests can add one); a tenant's model
    alias (core.store.aliases) resolves to its target.
    """
    if is_alias_name(name):
        alias = find_alias(session, name=name, tenant=tenant)
        return resolve_embedding_model(session, settings, name=alias.target, tenant=alias.tenant_id, aliases=aliases)
    if name in aliases:
        return name
    if name.startswith("job_"):
        job = get_owned(session, Job, name, what="model", tenant=tenant, field="model")
        if job.task != TaskKind.TEXT_CLASSIFICATION:
            raise ValidationFailed("model", f"job {name!r} is a {job.task} job; embeddings come from "
                                   "text-classification jobs (their fine-tuned encoder)")
        if job.status != JobStatus.SUCCEEDED:
            raise ValidationFailed("model", f"job {name!r} is {job.status}; only succeeded jobs serve embeddings")
        return job.id
    if NAME_RE.match(name):
        folder = settings.home / "models" / name  # NAME_RE admits no separators: this stays under models/
        if folder.is_dir() and is_sentence_transformer(folder):
            return str(folder.resolve())
    raise NotFound(f"model {name!r} not found: embeddings come from {', '.join(aliases) or 'built-in aliases'}, "
                   "a sentence-transformers folder under <home>/models, or a succeeded text-classification job",
                   field="model")
