"""What a job's adapter and method ask of its datasets and base model, checked at POST /jobs.

A causal-lm job trains on a text corpus (a table's text column, or .txt) with next-token loss, or on a chat
dataset (core.chat_data): a chat or completion dataset with method sft (loss on the replies), a preference
dataset with method dpo. DPO needs a base_model and an adapter (its reference model is the base with the
adapter switched off); chat data needs a base_model whose tokenizer has a chat template (a completion dataset
renders without one). Text-classification jobs train on tables only. The worker picks the engine by the same
rule (core.jobspec.engine_name).
"""

from __future__ import annotations

from typing import Any

from core.adapters import PreferenceConfig
from core.base_models import has_chat_template
from core.chat_data import CHAT_FORMATS
from core.errors import ValidationFailed
from core.jobspec import CausalLMJob, JobSpec
from core.models import Dataset

NEEDS_TEMPLATE = ("chat", "preference")


def is_chat(dataset: Dataset | None) -> bool:
    """A chat, preference or completion dataset (no text column: its records are rendered)."""
    return dataset is not None and dataset.format in CHAT_FORMATS


def method_fields(spec: JobSpec, train: Dataset, evaluation: Dataset | None,
                  base_path: str | None) -> dict[str, Any]:
    """The row's adapter and method columns, after checking the data suits them (422 naming the field)."""
    adapter = getattr(spec, "adapter", None)
    if adapter is not None and spec.base_model is None:
        raise ValidationFailed("adapter", "an adapter trains on top of a base_model; a fresh model trains in full")
    if not isinstance(spec, CausalLMJob):
        if is_chat(train) or is_chat(evaluation):
            field = "train_dataset" if is_chat(train) else "eval_dataset"
            raise ValidationFailed(field, f"{spec.task} jobs train on tables; chat datasets train causal-lm jobs")
        return {"adapter": adapter.model_dump(mode="json") if adapter else None, "method": None}
    dpo = isinstance(spec.method, PreferenceConfig)
    wanted = ("preference",) if dpo else ("chat", "completion")
    for field, dataset in (("train_dataset", train), ("eval_dataset", evaluation)):
        if dataset is None:
            continue
        if dpo and dataset.format not in wanted:
            raise ValidationFailed(field, f"method dpo trains on a preference dataset; {dataset.id} is "
                                          f"{dataset.format}")
        if not dpo and dataset.format == "preference":
            raise ValidationFailed(field, f"{dataset.id} is a preference dataset: train it with "
                                          "method {\"method\": \"dpo\"} and an adapter")
        if field == "eval_dataset" and is_chat(dataset) != is_chat(train):
            raise ValidationFailed(field, "the eval dataset must be chat data when the training data is, "
                                          "and a text corpus when it is one")
    if dpo and adapter is None:
        raise ValidationFailed("adapter", "method dpo needs an adapter: its reference model is the base with "
                                          "the adapter switched off")
    if is_chat(train):
        if spec.base_model is None or base_path is None:
            raise ValidationFailed("base_model", f"a {train.format} dataset fine-tunes a base_model")
        if train.format in NEEDS_TEMPLATE and has_chat_template(base_path) is False:
            raise ValidationFailed("base_model", f"{spec.base_model} has no chat template (tokenizer_config.json "
                                                 "chat_template), so its conversations cannot be rendered; use a "
                                                 "chat model or a completion dataset")
    return {"adapter": adapter.model_dump(mode="json") if adapter else None,
            "method": spec.method.model_dump(mode="json")}
