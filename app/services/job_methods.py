"""What a job's adapter and method ask of its datasets and base model, checked at POST /jobs.

A causal-lm job trains on a text corpus (a table's text column, or .txt) with next-token loss, or on a chat dataset
(core.chat_data): a chat or completion dataset with method sft (loss on the replies), a preference dataset with
method dpo, a prompts dataset with method reinforcement (GRPO, rewarded by a grader). DPO needs a base_model and an
adapter (its reference model is the base with the adapter switched off); so does reinforcement with a KL penalty
(beta > 0), which trains all weights only without one; chat data needs a base_model whose tokenizer has a chat
template (a completion dataset renders without one). A kind trains on chat data when its registry entry names
engine variants for it (JobKind.chat_data), else on tables only. The worker picks the engine by the same rule
(worker.engines.training.kinds.engine_name).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from core.auth import Principal
from core.batch_data import BATCH_FORMAT
from core.chat_data import CHAT_FORMATS
from core.errors import NotFound, ValidationFailed
from core.jobspec import JobSpec, kind_of, kinds_where
from core.pretrained import builtin_aliases, has_chat_template, resolve_base_model
from core.rows import Dataset, Job, JobStatus
from core.served_models import NAME_RE, is_job_model
from core.settings import Settings
from core.store.owned import get_owned

NEEDS_TEMPLATE = ("chat", "preference", "prompts")
# The datasets each method trains on (the job spec's method -> core.chat_data formats).
METHOD_FORMATS = {"sft": ("chat", "completion"), "dpo": ("preference",), "reinforcement": ("prompts",)}
FORMAT_METHODS = {"preference": "dpo", "prompts": "reinforcement"}


def resolve_base(session: Session, settings: Settings, principal: Principal, spec: JobSpec) -> str | None:
    """Where the worker loads the job's base_model from (the row's base_model_path), in the one model namespace
    GET /v1/models lists: a built-in alias, a folder under <home>/models by its name, a finished job of the same
    kind by its id (the worker fetches its model; an adapter is folded into its base first), an allowed local
    folder, or a hub id. None without a base_model."""
    name = spec.base_model
    if name is None:
        return None
    if is_job_model(name):
        try:
            job = get_owned(session, Job, name, what="job", tenant=principal.scope, field="base_model")
        except NotFound as exc:
            raise ValidationFailed("base_model", f"job {name!r} does not exist") from exc
        if job.status != JobStatus.SUCCEEDED or job.task != spec.task:
            raise ValidationFailed("base_model", f"job {name!r} is a {job.status} {job.task} job; a {spec.task} "
                                                 f"job continues from a succeeded {spec.task} job")
        return job.id
    models = settings.home / "models"
    roots = settings.local_model_roots
    if name not in builtin_aliases() and NAME_RE.match(name) and (models / name).is_dir():
        name, roots = str(models / name), [*roots, models]  # NAME_RE admits no separators: it stays under models/
    return resolve_base_model(name, local_roots=roots, max_bytes=settings.max_model_bytes)


def is_chat(dataset: Dataset | None) -> bool:
    """A chat, preference or completion dataset (no text column: its records are rendered)."""
    return dataset is not None and dataset.format in CHAT_FORMATS


def require_table_data(spec: JobSpec, train: Dataset, evaluation: Dataset | None) -> None:
    """Chat datasets train causal-lm jobs only, batch files none (checked before any column is looked for)."""
    for field, dataset in (("train_dataset", train), ("eval_dataset", evaluation)):
        if dataset is not None and dataset.format == BATCH_FORMAT:
            raise ValidationFailed(field, f"{dataset.id} is a batch file (requests to run), not training data")
    if not kind_of(spec.task).chat_data and (is_chat(train) or is_chat(evaluation)):
        field = "train_dataset" if is_chat(train) else "eval_dataset"
        raise ValidationFailed(field, f"{spec.task} jobs train on tables; chat datasets train "
                                      f"{kinds_where(lambda kind: kind.chat_data)} jobs")


def require_quantizable(spec: JobSpec) -> None:
    """Refuse (422 naming adapter.quantize_base) a 4-bit base where its kind's engines load none, or where the
    job would shard it (FSDP splits plain tensors; a 4-bit weight is packed bytes and its quantization state)."""
    adapter = getattr(spec, "adapter", None)
    if adapter is None or adapter.quantize_base is None:
        return
    kind = kind_of(spec.task)
    if not kind.quantizes_base:
        raise ValidationFailed("adapter.quantize_base", f"a {spec.task} adapter trains on the full-precision base; "
                               f"a 4-bit base (QLoRA) is for {kinds_where(lambda k: k.quantizes_base)} jobs")
    if spec.devices > 1 and spec.hyperparameters.sharding == "fsdp":
        raise ValidationFailed("adapter.quantize_base", "a 4-bit base is not sharded: on several devices each keeps "
                               "a whole copy (hyperparameters.sharding ddp or auto)")


def method_fields(spec: JobSpec, train: Dataset, evaluation: Dataset | None,
                  base_path: str | None) -> dict[str, Any]:
    """The row's adapter and method columns, after checking the data suits them (422 naming the field)."""
    adapter = getattr(spec, "adapter", None)
    if adapter is not None and spec.base_model is None:
        raise ValidationFailed("adapter", "an adapter trains on top of a base_model; a fresh model trains in full")
    method = getattr(spec, "method", None)  # the kinds with methods (JobKind.methods) have the field
    if method is None:
        return {"adapter": adapter, "method": None}
    name = method.method
    wanted = METHOD_FORMATS[name]
    for field, dataset in (("train_dataset", train), ("eval_dataset", evaluation)):
        if dataset is None:
            continue
        if name != "sft" and dataset.format not in wanted:
            raise ValidationFailed(field, f"method {name} trains on a {wanted[0]} dataset; {dataset.id} is "
                                          f"{dataset.format}")
        if name == "sft" and dataset.format in FORMAT_METHODS:
            raise ValidationFailed(field, f"{dataset.id} is a {dataset.format} dataset: train it with method "
                                          f"{{\"method\": \"{FORMAT_METHODS[dataset.format]}\"}}")
        if field == "eval_dataset" and is_chat(dataset) != is_chat(train):
            raise ValidationFailed(field, "the eval dataset must be chat data when the training data is, "
                                          "and a text corpus when it is one")
    if name == "dpo" and adapter is None:
        raise ValidationFailed("adapter", "method dpo needs an adapter: its reference model is the base with "
                                          "the adapter switched off")
    hp = spec.hyperparameters
    if "metric_for_best" in hp.model_fields_set and (hp.metric_for_best == "eval_reward") != (name == "reinforcement"):
        raise ValidationFailed("hyperparameters.metric_for_best", "eval_reward (the mean reward of the validation "
                                                                  "answers) is the one eval metric method "
                                                                  "reinforcement reports, and no other method does")
    if name == "reinforcement" and adapter is None and getattr(method, "beta", 0) > 0:
        raise ValidationFailed("adapter", "method reinforcement with a KL penalty (beta > 0) needs an adapter: its "
                                          "reference model is the base with the adapter switched off; give one, or "
                                          "beta 0 to train all weights")
    if is_chat(train):
        if spec.base_model is None or base_path is None:
            raise ValidationFailed("base_model", f"a {train.format} dataset fine-tunes a base_model")
        if train.format in NEEDS_TEMPLATE and has_chat_template(base_path) is False:
            raise ValidationFailed("base_model", f"{spec.base_model} has no chat template (tokenizer_config.json "
                                                 "chat_template), so its conversations cannot be rendered; use a "
                                                 "chat model or a completion dataset")
    return {"adapter": adapter, "method": method}
