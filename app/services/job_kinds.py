"""The API side of the job-kind registry (core.jobspec holds the kinds): each kind's own admission checks.

POST /jobs validates what every job shares (datasets, columns, devices, method, metric_for_best), then the checks
the job's kind names (`JobKind.admission`, a `module:function` reference resolved here): they refuse what the kind
cannot train (422 naming the field) and resolve the row's kind-specific columns (base_model_path, labels,
label_column, model_config). `check_kinds` resolves every registered kind's checks when the app is built, so a kind
without them stops the API from starting rather than failing its first request.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable
from typing import Any

from app.services.job_methods import is_chat
from core.adapters import AdapterConfig
from core.capacity import largest_device
from core.chat_data import MAX_LENGTH as CHAT_MAX_LENGTH
from core.chat_data import longest_tokens
from core.errors import ValidationFailed
from core.estimate import Head, adapter_sizes, architecture, fitting_memory, format_bytes, load_model_config
from core.hyperparams import Hyperparameters, LMHyperparameters, weight_shards
from core.jobspec import KINDS, CausalLMJob, ClassificationJob, JobKind, JobSpec, kind_of, resolve_ref
from core.lm_config import DEFAULT_BLOCK_SIZE, GPT2_VOCAB_SIZE, resolve_block_size, validate_model_config
from core.precision import auto_precision
from core.protocol import ErrorCode
from core.reinforcement import ReinforcementConfig, graders_of
from core.rows import Dataset
from core.settings import Settings
from core.tabular import MAX_LABEL_CHARS, MAX_TRACKED_VALUES, label_space, name_list, short, to_label

# (settings, spec, train dataset, eval dataset, resolved base model path) -> the row's kind-specific columns
KindChecks = Callable[[Settings, Any, Dataset, Dataset | None, str | None], dict[str, Any]]
MAX_HINT_COLUMNS = 1000  # columns searched for a "did you mean" hint


class IncompleteKind(LookupError):
    """A registered job kind whose admission checks the API cannot resolve."""


def admission_checks(kind: JobKind) -> KindChecks:
    """The admission checks `kind` names; IncompleteKind when its reference names no function of their shape."""
    try:
        checks = resolve_ref(kind.admission)
    except (ImportError, AttributeError) as exc:
        raise IncompleteKind(f"{kind.name}: {kind.admission} names no admission checks: {exc}") from exc
    try:
        inspect.signature(checks).bind(None, None, None, None, None)
    except (TypeError, ValueError) as exc:
        raise IncompleteKind(f"{kind.name}: {kind.admission} does not take (settings, spec, train, evaluation, "
                             f"base_path): {exc}") from exc
    return checks  # type: ignore[no-any-return]


def check_kinds() -> None:
    """Every registered kind's admission checks resolve (the API builds its app only then); IncompleteKind naming
    each that does not."""
    found = []
    for kind in KINDS.values():
        try:
            admission_checks(kind)
        except IncompleteKind as exc:
            found.append(str(exc))
    if found:
        raise IncompleteKind("job kinds the API cannot admit: " + "; ".join(found))


def kind_fields(settings: Settings, spec: JobSpec, train: Dataset, evaluation: Dataset | None,
                base_path: str | None) -> dict[str, Any]:
    """Run the checks the spec's kind names; the row's columns they resolve."""
    return admission_checks(kind_of(spec.task))(settings, spec, train, evaluation, base_path)


def classification_fields(settings: Settings, spec: ClassificationJob, train: Dataset, evaluation: Dataset | None,
                          base_path: str | None) -> dict[str, Any]:
    """Checks and resolved columns of a text-classification job."""
    if spec.architecture is not None:
        raise ValidationFailed("model_config", "model_config applies to causal-lm jobs only")
    if spec.base_model is None or base_path is None:
        raise ValidationFailed("base_model", "text-classification needs a base_model (e.g. minilm-l6)")
    hp = spec.hyperparameters
    if hp.max_length > settings.max_text_length:
        raise ValidationFailed("hyperparameters.max_length",
                               f"must be at most {settings.max_text_length} on this server")
    label_column = spec.label_column or "label"
    require_column(train, label_column, "label_column")
    labels = labels_of(train, label_column, "train_dataset")
    if len(labels) < 2:
        raise ValidationFailed("train_dataset", f"label column {label_column!r} has only one class "
                               f"({labels[0]!r}); classification needs at least two")
    if evaluation is not None:
        require_column(evaluation, label_column, "eval_dataset")
        unseen = sorted(map(str, set(labels_of(evaluation, label_column, "eval_dataset")) - set(labels)))
        if unseen:
            raise ValidationFailed("eval_dataset", f"labels not present in the training data: {unseen[:10]}")
    require_fit(settings, load_model_config(base_path), "base_model", head="classifier", hp=hp,
                seq_len=hp.max_length, num_labels=len(labels), devices=spec.devices, adapter=spec.adapter)
    return {"base_model_path": base_path, "label_column": label_column, "labels": labels}


def causal_lm_fields(settings: Settings, spec: CausalLMJob, train: Dataset, evaluation: Dataset | None,
                     base_path: str | None) -> dict[str, Any]:
    """Checks of a causal-lm job: continue from a causal LM, or train a fresh GPT-2 of a given shape."""
    if spec.label_column is not None:
        raise ValidationFailed("label_column", "causal-lm jobs have no labels")
    hp = spec.hyperparameters
    if base_path is not None:
        if spec.architecture is not None:
            raise ValidationFailed("model_config", "give either base_model or model_config, not both")
        base_config = load_model_config(base_path) or {}
        context = base_config.get("max_position_embeddings") or base_config.get("n_positions")
        default_block = min(context, DEFAULT_BLOCK_SIZE) if isinstance(context, int) else DEFAULT_BLOCK_SIZE
        seq_len = hp.block_size or default_block
        if is_chat(train):
            # A batch is padded to its longest conversation, cut at block_size (chat_data.MAX_LENGTH by default):
            # the data's longest record, known since its validation, bounds it, and so does the model's context.
            longest = longest_tokens(train.column_stats)
            seq_len = min(hp.block_size or CHAT_MAX_LENGTH, longest or CHAT_MAX_LENGTH,
                          context if isinstance(context, int) else CHAT_MAX_LENGTH)
        loss_tokens = None
        if isinstance(spec.method, ReinforcementConfig):  # each prompt trains `samples` rows of prompt + answer
            check_reinforcement(settings, spec.method, prompt_tokens=seq_len,
                                context=context if isinstance(context, int) else None)
            hp = hp.model_copy(update={"batch_size": hp.batch_size * spec.method.samples})
            seq_len += spec.method.max_completion_tokens
            loss_tokens = hp.batch_size * spec.method.max_completion_tokens  # only the answers carry a target
        require_fit(settings, base_config, "base_model", head="causal-lm", hp=hp, seq_len=seq_len,
                    devices=spec.devices, adapter=spec.adapter, loss_tokens=loss_tokens,
                    shardable=not isinstance(spec.method, ReinforcementConfig)
                    and not (spec.adapter and spec.adapter.quantize_base))
        return {"base_model_path": base_path, "labels": []}
    try:
        architecture = validate_model_config(spec.architecture or {})
    except ValueError as exc:
        field = str(exc).split(":", 1)[0].split(" ", 1)[0]
        raise ValidationFailed(field if field.startswith("model_config") else "model_config", str(exc)) from exc
    if hp.block_size is not None and hp.block_size > architecture["n_positions"]:
        raise ValidationFailed("hyperparameters.block_size",
                               f"must not exceed model_config.n_positions ({architecture['n_positions']})")
    require_fit(settings, {**architecture, "vocab_size": GPT2_VOCAB_SIZE, "model_type": "gpt2"}, "model_config",
                head="causal-lm", hp=hp, seq_len=resolve_block_size(hp.block_size, architecture["n_positions"]),
                devices=spec.devices)
    return {"base_model_path": None, "model_config_": architecture, "labels": []}


def check_reinforcement(settings: Settings, method: ReinforcementConfig, *, prompt_tokens: int,
                        context: int | None) -> None:
    """A reinforcement method's bounds: completions sampled per prompt (TRAINSERVE_REINFORCEMENT_MAX_SAMPLES),
    graders a multi grader combines (TRAINSERVE_MAX_GRADERS), and the longest prompt the job keeps (its tokens)
    plus max_completion_tokens within the model's context (a rollout past it has no positions)."""
    for name in ("samples", "eval_samples"):
        if (samples := getattr(method, name)) > settings.reinforcement_max_samples:
            raise ValidationFailed(f"method.reinforcement.{name}", f"{samples} completions per prompt; at most "
                                   f"{settings.reinforcement_max_samples} on this server")
    graders = len(graders_of(method.grader))
    if graders > settings.max_graders:
        raise ValidationFailed("method.reinforcement.grader.graders", f"{graders} graders; a multi grader combines "
                               f"at most {settings.max_graders} on this server")
    if context is not None and prompt_tokens + method.max_completion_tokens > context:
        raise ValidationFailed(
            "method.reinforcement.max_completion_tokens",
            f"{method.max_completion_tokens} tokens after prompts of up to {prompt_tokens} (the longest prompt, or "
            f"block_size) exceed the model's context of {context}; lower max_completion_tokens (at most "
            f"{max(context - prompt_tokens, 0)} here) or block_size")


def require_fit(settings: Settings, model_config: dict[str, Any] | None, model_field: str, *, head: Head,
                hp: Hyperparameters | LMHyperparameters, seq_len: int, num_labels: int = 2, devices: int = 1,
                adapter: AdapterConfig | None = None, loss_tokens: int | None = None, shardable: bool = True) -> None:
    """Refuse (422 does_not_fit) a job whose estimated peak memory exceeds the largest device a live worker
    reported, or TRAINSERVE_ASSUMED_DEVICE_BYTES while none has; without a config to estimate from, admit.

    The estimate counts the techniques the worker will use: the chunked loss of a causal LM (`loss_tokens` of its
    positions carry a target, at most), gradient checkpointing as the job asks or where it is needed to fit, and
    FSDP's shards (`shardable` is False for a job that keeps whole replicas: core.hyperparams.weight_shards).
    """
    try:
        shards = weight_shards(hp.sharding, devices, shardable=shardable)
    except ValueError as exc:
        raise ValidationFailed("hyperparameters.sharding", str(exc)) from exc
    arch = architecture(model_config) if model_config else None
    if arch is None:
        return  # e.g. a hub id not in the local cache: the worker estimates once it has the config
    device = largest_device(settings.resolved_redis_url, devices=devices)
    limit = device.total_bytes if device is not None else settings.assumed_device_bytes
    if not limit:
        return
    # The assumed device is a modern GPU; a CPU's bf16 calibration is the worker's to make (fp32 assumed here).
    precision: str = hp.precision
    if precision == "auto":
        precision = (auto_precision(is_cuda=True) if device is None else
                     auto_precision(is_cuda=device.is_cuda, bf16_supported=device.bf16))
    # On N devices each one runs a share of every micro-batch (the job's batch_size is the global one).
    sizes: dict[str, Any] = {
        "head": head, "batch_size": math.ceil(hp.batch_size / devices), "seq_len": seq_len, "precision": precision,
        "num_labels": num_labels, **adapter_sizes(arch, adapter, head, num_labels),
        # an encoder trains with eager attention on a CPU (worker.engines.training.encoder), SDPA on a GPU
        **({"fused_attention": device is None or device.is_cuda} if head == "classifier" else {}),
        "chunked_loss": head == "causal-lm" and shards == 1,  # a sharded output layer: the model's own logits
        "loss_tokens": None if loss_tokens is None else math.ceil(loss_tokens / devices), "shards": shards}
    estimate = fitting_memory(arch, limit=limit, checkpointing=hp.gradient_checkpointing, **sizes)
    if estimate.total_bytes <= limit:
        return
    where = (f"the largest device a live worker has reported ({device.device} on {device.worker}, "
             f"{format_bytes(limit)})" if device is not None else
             f"the {format_bytes(limit)} assumed while no live worker has reported its device "
             "(TRAINSERVE_ASSUMED_DEVICE_BYTES)")
    if estimate.fixed_bytes > limit:
        field, hint = model_field, "use a smaller model"
    elif not estimate.checkpointing and fitting_memory(arch, limit=limit, checkpointing=True,
                                                       **sizes).total_bytes <= limit:
        field, hint = "hyperparameters.gradient_checkpointing", "it fits with gradient checkpointing (true or null)"
    else:
        field, hint = "hyperparameters.batch_size", ("lower batch_size (and raise gradient_accumulation_steps for "
                                                     "the same effective batch) or the sequence length")
    raise ValidationFailed(field, f"this job needs about {estimate.describe()}, more than {where}; {hint}",
                           code=ErrorCode.DOES_NOT_FIT)


def require_column(dataset: Dataset, column: str, field: str) -> None:
    """Refuse (422 naming `field`) a column the dataset does not have, with the closest one as a hint."""
    if column in dataset.columns:
        return
    # Bounded work and a bounded message, even for rows stored before datasets had a column limit.
    candidates = dataset.columns[:MAX_HINT_COLUMNS]
    close = difflib.get_close_matches(column, candidates, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValidationFailed(field, f"column {short(column)} is not in dataset {dataset.id} "
                           f"(columns: {name_list(dataset.columns)}){hint}")


def labels_of(dataset: Dataset, column: str, field: str) -> list[int | str]:
    """The label space of a dataset's column, from its stats (422 naming `field` when it cannot be one)."""
    stats = dataset.column_stats.get(column, {})
    if stats.get("empty"):
        raise ValidationFailed(field, f"{stats['empty']} rows have an empty {short(column)} label")
    values = stats.get("values")
    if values is None:
        raise ValidationFailed(field, f"column {short(column)} has over {MAX_TRACKED_VALUES} distinct values or "
                               f"values over {MAX_LABEL_CHARS} characters; is it the label?")
    # Stats keys are strings; numeric labels come back as ints, as the worker reads them, so the maps agree.
    return label_space([to_label(v) for v in values])

