"""Fine-tune a sequence-classification model: the classifier recipe of the one training loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from core.adapters import AdapterConfig
from core.estimate import adapter_sizes, architecture
from core.hyperparams import Hyperparameters, default
from worker.engines.device import DevicePlan
from worker.engines.models import encoder_batches as batching
from worker.engines.models import manifest as manifests
from worker.engines.training import adapters, artifacts
from worker.engines.training import tabular_data as data
from worker.engines.training.encoder import attention_implementation, last_layer_at_cls
from worker.engines.training.loop import (
    OutOfMemory,
    RunConfig,
    Setup,
    TrainCallbacks,
    TrainResult,
    fit_memory,
    lr_at,
    run,
    split_micro_batches,
    use_checkpointing,
)

if TYPE_CHECKING:
    from worker.engines.training.loop_types import TrainedModel

# Re-exported: the runner, tests and benchmarks import the engine's public names from here.
__all__ = ["OutOfMemory", "TrainCallbacks", "TrainConfig", "TrainResult", "classification_metrics", "lr_at",
           "split_micro_batches", "train"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig(RunConfig):
    """Everything one fine-tuning run needs; paths are local, hyperparameters already validated."""

    base_model: str
    text_column: str
    label_column: str
    # Defaults: the hyperparameters model's (core.hyperparams), the one place they live.
    max_length: int = default(Hyperparameters, "max_length")
    epochs: float = default(Hyperparameters, "epochs")
    batch_size: int = default(Hyperparameters, "batch_size")
    learning_rate: float = default(Hyperparameters, "learning_rate")
    weight_decay: float = default(Hyperparameters, "weight_decay")
    freeze_word_embeddings: bool = default(Hyperparameters, "freeze_word_embeddings")
    adapter: AdapterConfig | None = None  # LoRA on the base: the adapter and the new head train and are saved
    seed: int = default(Hyperparameters, "seed")


def train(config: TrainConfig, callbacks: TrainCallbacks | None = None) -> TrainResult:
    """Run (or resume) a fine-tuning job to completion or cancellation."""
    return run(config, ClassifierRecipe(config), callbacks)


class ClassifierRecipe:
    """Texts and labels from a table, a classification head on a base model, cross-entropy, accuracy and F1."""

    unit = "samples"
    adam_betas = (0.9, 0.999)  # as BERT and HF Trainer

    def __init__(self, config: TrainConfig) -> None:
        if config.max_length < 1:
            raise ValueError(f"max_length must be at least 1, got {config.max_length}")
        if config.adapter is not None and config.adapter.quantize_base is not None:
            raise ValueError("adapter.quantize_base: a text-classification adapter trains on the full-precision base")
        self.config = config

    def build(self, plan: DevicePlan) -> Setup:
        """Tokenize train (and eval) rows, then load the base model with a fresh head for their labels."""
        config = self.config
        self.plan = plan
        self.tokenizer = AutoTokenizer.from_pretrained(config.base_model)
        self.labels, self.train_set, self.eval_set = _prepare_data(config, self.tokenizer)
        model_config = AutoConfig.from_pretrained(config.base_model, trust_remote_code=False)
        arch = architecture(model_config.to_dict())
        longest = int(self.train_set.lengths.max()) if len(self.train_set) else config.max_length
        adapter = config.adapter
        estimate = fit_memory(arch, plan, config, head="classifier", batch_size=config.batch_size, seq_len=longest,
                              num_labels=len(self.labels),
                              **adapter_sizes(arch, adapter, "classifier", len(self.labels)),
                              fused_attention=attention_implementation(plan) != "eager")
        self.model: TrainedModel = _load_model(config.base_model, self.labels, attention_implementation(plan))
        cls_only = last_layer_at_cls(self.model)
        if config.freeze_word_embeddings:
            freeze_word_embeddings(self.model)
        if adapter is not None:
            self.model = adapters.apply_adapter(self.model, adapter, "text-classification")
        settings = {"adapter": adapter.model_dump()} if adapter else {}
        module: torch.nn.Module = self.model  # (transformers' `to` is typed without its self)
        module.to(plan.device)  # in place for modules
        checkpointing = use_checkpointing(module, estimate, config)
        num_eval = len(self.eval_set) if self.eval_set is not None else 0
        return Setup(
            model=self.model, num_examples=len(self.train_set), units_per_example=1,
            identity={"num_train": len(self.train_set), "batch_size": config.batch_size,
                      "gradient_accumulation_steps": config.gradient_accumulation_steps, "seed": config.seed,
                      "labels": self.labels, **settings},
            info={"num_train": len(self.train_set), "num_eval": num_eval, "labels": self.labels},
            hyperparameters={"max_length": config.max_length, "length_grouped": True, "last_layer_at_cls": cls_only,
                             "attention": self.model.config._attn_implementation,
                             "freeze_word_embeddings": config.freeze_word_embeddings, **settings,
                             "memory": {"gradient_checkpointing": checkpointing}},
            sparse_tables=(input_embeddings(self.model),),
        )

    def epoch_steps(self, epoch: int) -> list[list[list[int]]]:
        """Length-grouped batches of similar-length rows in a seeded order."""
        config = self.config
        return data.epoch_steps(self.train_set.lengths, config.batch_size, config.gradient_accumulation_steps,
                                config.seed, epoch)

    def loss(self, model: torch.nn.Module, micro_batch: list[int]) -> torch.Tensor:
        """The model's own cross-entropy over the rows, padded to the longest of them."""
        batch = batching.collate(self.train_set, micro_batch)
        return model(**{name: tensor.to(self.plan.device) for name, tensor in batch.items()}).loss

    def evaluate(self) -> dict[str, float] | None:
        """Loss, accuracy and F1 over the whole eval set (see classification_metrics for which F1)."""
        eval_set = self.eval_set
        if eval_set is None:
            return None
        predictions = np.empty(len(eval_set), dtype=np.int64)
        loss_sum = 0.0
        for indices in batching.sorted_batches(eval_set, self.config.batch_size):
            batch = {name: tensor.to(self.plan.device) for name, tensor in batching.collate(eval_set, indices).items()}
            labels = batch.pop("labels")
            logits = self.model(**batch).logits.float()
            loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
            predictions[indices] = logits.argmax(dim=-1).cpu().numpy()
        metrics = {"eval_loss": loss_sum / max(len(eval_set), 1)}
        metrics.update(classification_metrics(predictions, eval_set.label_ids, len(self.labels)))
        return metrics

    def save(self, metrics: dict[str, float], hyperparameters: dict[str, Any], plan: DevicePlan) -> dict[str, Any]:
        """save_pretrained model and tokenizer, with a manifest that carries the label map."""
        config = self.config
        manifest = manifests.build_manifest(
            base_model=str(config.base_model), base_model_name=config.base_model_name, labels=self.labels,
            hyperparameters=hyperparameters, dataset_hashes=dict(config.dataset_hashes), metrics=metrics,
            plan=plan, data={"text_column": config.text_column, "label_column": config.label_column,
                             "num_train": len(self.train_set),
                             "num_eval": len(self.eval_set) if self.eval_set is not None else 0},
        )
        if config.adapter is not None:
            manifest["adapter"] = adapters.adapter_summary(self.model, config.adapter)
        artifacts.save_final(config.output_dir, self.model, self.tokenizer, manifest,
                             merged=bool(config.adapter and config.adapter.merge))
        return manifest


def classification_metrics(predictions: np.ndarray, targets: np.ndarray, num_labels: int) -> dict[str, float]:
    """Accuracy and F1: binary F1 of label id 1 for two labels, macro F1 over all labels otherwise."""
    accuracy = float(np.mean(predictions == targets)) if len(targets) else 0.0
    classes = [1] if num_labels == 2 else range(num_labels)
    scores = []
    for label in classes:
        true_pos = int(np.sum((predictions == label) & (targets == label)))
        predicted = int(np.sum(predictions == label))
        actual = int(np.sum(targets == label))
        scores.append(2 * true_pos / (predicted + actual) if predicted + actual else 0.0)
    return {"eval_accuracy": accuracy, "eval_f1": float(np.mean(scores))}


def input_embeddings(model: TrainedModel) -> torch.nn.Embedding:
    """The model's token-embedding table."""
    table = model.get_input_embeddings()
    if not isinstance(table, torch.nn.Embedding):
        raise TypeError(f"expected the token embeddings to be an nn.Embedding, got {type(table).__name__}")
    return table


def freeze_word_embeddings(model: TrainedModel) -> None:
    """Keep the token-embedding table as pretrained: no gradient, no optimizer state, no update."""
    # It is about half of a small BERT's parameters, yet a batch of short texts touches a few hundred of
    # its 30k rows: its dense gradient, clipping and AdamW update are ~10% of a profiled CPU step (the
    # end-to-end gain was within noise, bench/README.md). Opt-in: a poorly trained table would stay poor.
    input_embeddings(model).weight.requires_grad_(False)


def _prepare_data(config: TrainConfig, tokenizer) -> tuple[list[int | str], batching.Encoded, batching.Encoded | None]:
    examples = data.read_examples(config.train_file, config.text_column, config.label_column)
    labels = data.build_label_map(examples.labels)
    train_ids = data.label_ids_for(examples.labels, labels, "train")
    train_set = data.encode(tokenizer, examples.texts, train_ids, config.max_length)
    eval_set = None
    if config.eval_file is not None:
        held_out = data.read_examples(config.eval_file, config.text_column, config.label_column)
        eval_ids = data.label_ids_for(held_out.labels, labels, "eval")
        eval_set = data.encode(tokenizer, held_out.texts, eval_ids, config.max_length)
    return labels, train_set, eval_set


def _load_model(base_model: str, labels: list[int | str], attention: str | None) -> PreTrainedModel:
    # ignore_mismatched_sizes: a base that is itself a classifier with another label count gets a
    # fresh head instead of a shape error. `attention` is encoder.attention_implementation's choice.
    return AutoModelForSequenceClassification.from_pretrained(
        base_model, attn_implementation=attention, num_labels=len(labels),
        id2label={i: str(label) for i, label in enumerate(labels)},
        label2id={str(label): i for i, label in enumerate(labels)}, ignore_mismatched_sizes=True,
        trust_remote_code=False, use_safetensors=True,  # never unpickle a .bin
    )
