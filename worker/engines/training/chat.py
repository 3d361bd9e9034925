"""Fine-tune a causal LM on conversations (loss on assistant turns) or on preference pairs (DPO): a task of the loop.

The data is a chat, completion or preference dataset (core.chat_data), each record rendered with the base model's
chat template (training/chat_render.py); records whose replies fall past max_length are left out and counted.
With `adapter` the model is the base plus LoRA (worker.engines.training.adapters), the base in 4-bit NF4 where the
adapter asks (QLoRA: worker.engines.training.quantized); DPO needs one, because its reference model is the base with
the adapter switched off (worker.engines.training.dpo).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from core.adapters import AdapterConfig, PreferenceConfig
from core.chat_data import MAX_LENGTH, read_records
from core.errors import DomainError
from core.estimate import MemoryEstimate, adapter_sizes, architecture
from core.hyperparams import LMHyperparameters, default, weight_shards
from worker.engines.device import DevicePlan
from worker.engines.models import manifest as manifests
from worker.engines.models.tokenizers import load_tokenizer_files
from worker.engines.training import adapters, artifacts, quantized
from worker.engines.training import tabular_data as data
from worker.engines.training.chat_render import Rendered, collate, render_preference, render_record
from worker.engines.training.dpo import preference_loss
from worker.engines.training.loop import (
    RunConfig,
    Setup,
    TrainCallbacks,
    TrainResult,
    fit_memory,
    run,
    use_checkpointing,
)
from worker.engines.training.packing import pack, saves_work
from worker.engines.training.token_loss import ModelChecks, memory_record, probe, shifted_targets, target_logprobs

if TYPE_CHECKING:
    from worker.engines.training.loop_types import TrainedModel

MAX_PERPLEXITY_LOSS = 100.0


@dataclass(frozen=True, kw_only=True)
class ChatTrainConfig(RunConfig):
    """One chat fine-tune (or DPO run with `preference`) of base_model; train_file is a chat-format JSONL."""

    base_model: str
    adapter: AdapterConfig | None = None
    preference: PreferenceConfig | None = None
    # Tokens per rendered conversation, the start kept (None: core.chat_data.MAX_LENGTH); the job's block_size.
    max_length: int | None = default(LMHyperparameters, "block_size")
    # Defaults: the causal-lm kind's hyperparameters model (core.hyperparams), the one place they live.
    epochs: float = default(LMHyperparameters, "epochs")
    batch_size: int = default(LMHyperparameters, "batch_size")
    learning_rate: float = default(LMHyperparameters, "learning_rate")
    weight_decay: float = default(LMHyperparameters, "weight_decay")
    seed: int = default(LMHyperparameters, "seed")


def train_chat(config: ChatTrainConfig, callbacks: TrainCallbacks | None = None) -> TrainResult:
    """Run (or resume) a chat fine-tune or a DPO run to completion or cancellation."""
    return run(config, ChatRecipe(config), callbacks)


Example = Rendered | tuple[Rendered, Rendered]  # a conversation, or a (preferred, non-preferred) pair


class ChatRecipe:
    """Rendered conversations (or pairs), an optionally adapted causal LM, assistant-token loss or DPO's."""

    unit = "samples"
    adam_betas = (0.9, 0.999)

    def __init__(self, config: ChatTrainConfig) -> None:
        if config.preference is not None and config.adapter is None:
            raise ValueError("method 'dpo' needs an adapter: the reference model is the base with it switched off")
        self.shardable = not (config.adapter and config.adapter.quantize_base)  # a 4-bit base is never sharded
        self.max_length = MAX_LENGTH if config.max_length is None else config.max_length
        if self.max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {self.max_length}")
        self.config = config

    def build(self, plan: DevicePlan) -> Setup:
        """Render the records with the base model's template, then load (and adapt) the model if it fits."""
        config = self.config
        self.plan = plan
        self.tokenizer = load_tokenizer_files(config.base_model)
        self.pad_id = next(i for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0) if i is not None)
        self.train_set, self.dropped = self._examples(config.train_file)
        if not self.train_set:
            raise ValueError(f"no training record keeps a reply within max_length={self.max_length} tokens")
        self.eval_set = self._examples(config.eval_file)[0] if config.eval_file is not None else []
        self.lengths = np.array([_length(example) for example in self.train_set])
        rows = config.batch_size * (2 if config.preference else 1)
        self.policy = load_policy(config, plan, rows=rows, seq_len=int(self.lengths.max()),
                                  shardable=self.shardable)
        self.model = self.policy.model
        self.arch = architecture(self.model.config.to_dict())
        self.packed_steps = self.steps = 0
        settings = {"adapter": config.adapter.model_dump() if config.adapter else None,
                    "preference": config.preference.model_dump() if config.preference else None}
        return Setup(
            model=self.model, num_examples=len(self.train_set), units_per_example=1,
            identity={"num_train": len(self.train_set), "max_length": self.max_length, "seed": config.seed,
                      "batch_size": config.batch_size,
                      "gradient_accumulation_steps": config.gradient_accumulation_steps, **settings},
            info={"num_train": len(self.train_set), "num_eval": len(self.eval_set), "dropped": self.dropped,
                  "format": self.format, "train_tokens_per_epoch": sum(map(_tokens, self.train_set))},
            # SFT packs a micro-batch into one row where that saves work and the model was checked to allow it.
            hyperparameters={"max_length": self.max_length, **settings, "memory": {
                **self.policy.describe(), "packing": self.policy.checks.packs and config.preference is None}},
        )

    def _examples(self, path: Any) -> tuple[list[Example], int]:
        """Each record rendered; the count of those with nothing left to learn after truncation."""
        config = self.config
        try:
            fmt, records = read_records(path)
        except DomainError as exc:  # the engine's contract is ValueError for bad input
            raise ValueError(f"{path.name}: {exc.message}") from exc
        wanted = ("preference",) if config.preference else ("chat", "completion")
        if fmt not in wanted:
            raise ValueError(f"{path.name} is a {fmt} dataset; this job needs a {' or '.join(wanted)} dataset")
        self.format = fmt
        kept: list[Example] = []
        for line_no, record in records:
            try:
                example: Example = (render_preference(self.tokenizer, record, max_length=self.max_length)
                                    if config.preference else
                                    render_record(self.tokenizer, fmt, record, max_length=self.max_length))
            except Exception as exc:  # noqa: BLE001 - a template's own error (raise_exception) names no line
                raise ValueError(f"{path.name} line {line_no}: the chat template cannot render it: {exc}") from exc
            parts = example if isinstance(example, tuple) else (example,)
            if all(part.trained_tokens for part in parts):
                kept.append(example)
        return kept, len(records) - len(kept)

    def epoch_steps(self, epoch: int) -> list[list[list[int]]]:
        """Length-grouped batches in a seeded order (less padding)."""
        config = self.config
        return data.epoch_steps(self.lengths, config.batch_size, config.gradient_accumulation_steps, config.seed,
                                epoch)

    def loss(self, model: torch.nn.Module, micro_batch: list[int]) -> torch.Tensor:
        """Mean loss over the assistant tokens of the rows, or the mean DPO loss over the pairs."""
        return self._loss(model, [self.train_set[i] for i in micro_batch])[0]

    def _loss(self, model: torch.nn.Module, examples: list[Example]) -> tuple[torch.Tensor, dict[str, Any]]:
        device, checks = self.plan.device, self.policy.checks
        if self.config.preference is None:
            singles = [e for e in examples if isinstance(e, Rendered)]
            if checks.packs and saves_work([len(e.input_ids) for e in singles], self.arch):
                self.packed_steps += model.training
                batch = {k: v.to(device) for k, v in pack(singles).items()}
            else:
                batch = {k: v.to(device) for k, v in collate(singles, self.pad_id).items()}
            self.steps += model.training
            return assistant_loss(model, checks, **batch), {}
        pairs = [e for e in examples if isinstance(e, tuple)]
        chosen, rejected = ({k: v.to(device) for k, v in collate([pair[side] for pair in pairs], self.pad_id).items()}
                            for side in (0, 1))
        return preference_loss(model, self.model, checks, chosen, rejected, self.config.preference.beta)

    def step_metrics(self) -> dict[str, float]:
        """The share of the step's micro-batches that ran packed (SFT), then reset."""
        if not self.steps:
            return {}
        share, self.packed_steps, self.steps = self.packed_steps / self.steps, 0, 0
        return {"packed_fraction": share}

    def evaluate(self) -> dict[str, float] | None:
        """Loss over the eval records (per assistant token, or per pair with DPO's reward accuracy)."""
        if not self.eval_set:
            return None
        total, weight, accuracy = 0.0, 0.0, 0.0
        size = self.config.batch_size
        for start in range(0, len(self.eval_set), size):
            examples = self.eval_set[start:start + size]
            loss, extra = self._loss(self.model, examples)
            count = (len(examples) if self.config.preference else
                     sum(e.trained_tokens for e in examples if isinstance(e, Rendered)))
            total, weight = total + loss.item() * count, weight + count
            accuracy += float(extra.get("reward_accuracy", 0.0)) * len(examples)
        loss_value = total / weight
        if self.config.preference:
            return {"eval_loss": loss_value, "eval_reward_accuracy": accuracy / len(self.eval_set)}
        return {"eval_loss": loss_value, "perplexity": math.exp(min(loss_value, MAX_PERPLEXITY_LOSS))}

    def save(self, metrics: dict[str, float], hyperparameters: dict[str, Any], plan: DevicePlan) -> dict[str, Any]:
        """The adapter folder (or the full model) with the tokenizer and a manifest naming the method and data."""
        config = self.config
        manifest = manifests.build_manifest(
            task="causal-lm", base_model=config.base_model, base_model_name=config.base_model_name or config.base_model,
            hyperparameters=hyperparameters, dataset_hashes=dict(config.dataset_hashes), metrics=metrics, plan=plan,
            data={"format": self.format, "num_train": len(self.train_set), "dropped": self.dropped,
                  "num_eval": len(self.eval_set), "max_length": self.max_length})
        manifest["method"] = "dpo" if config.preference else "sft"
        if config.adapter is not None:
            manifest["adapter"] = adapters.adapter_summary(self.model, config.adapter)
        artifacts.save_final(config.output_dir, self.model, self.tokenizer, manifest,
                             merged=bool(config.adapter and config.adapter.merge))
        return manifest


@dataclass(frozen=True)
class Policy:
    """A causal LM ready to tune, with what was decided about its memory."""

    model: TrainedModel
    checks: ModelChecks  # its output layer for the chunked loss, and whether its rows may pack
    checkpointing: bool  # gradient checkpointing on
    estimate: MemoryEstimate | None  # the peak it was admitted at (None: an architecture the estimate cannot read)
    quantized_base: dict[str, Any] | None = None  # the 4-bit base's format and backend (QLoRA), else None

    def describe(self) -> dict[str, Any]:
        """The manifest's record of the memory techniques the run used and the peak it was estimated at."""
        return memory_record(self.checks, self.checkpointing, self.estimate, self.quantized_base)


def load_policy(config: ChatTrainConfig, plan: DevicePlan, *, rows: int, seq_len: int,
                loss_tokens: int | None = None, shardable: bool = True) -> Policy:
    """The causal LM to tune on plan.device (with its LoRA adapter when given), refused first if the estimate of
    training `rows` sequences of `seq_len` tokens does not fit even with gradient checkpointing; `loss_tokens` is
    how many of them carry a target at most (the chunked loss's rows). On several devices each holds its share of
    the rows, and under FSDP its share of the states (core.hyperparams.weight_shards; `shardable` as the recipe
    says), with every position's logits: a sharded output layer is left to the model's own forward."""
    model_config = AutoConfig.from_pretrained(config.base_model, trust_remote_code=False)
    arch = architecture(model_config.to_dict())
    adapter = config.adapter
    devices, shards = config.devices, weight_shards(config.sharding, config.devices, shardable=shardable)
    sizes: dict[str, Any] = {"head": "causal-lm", "batch_size": math.ceil(rows / devices), "seq_len": seq_len,
                             "shards": shards, **adapter_sizes(arch, adapter),
                             "loss_tokens": None if loss_tokens is None else math.ceil(loss_tokens / devices)}
    estimate = fit_memory(arch, plan, config, chunked_loss=shards == 1, **sizes)
    four_bit = adapter is not None and adapter.quantize_base is not None
    base = (quantized.load_quantized(config.base_model, model_config, plan) if four_bit else
            AutoModelForCausalLM.from_pretrained(config.base_model, config=model_config, trust_remote_code=False,
                                                 use_safetensors=True))
    model: TrainedModel = base if adapter is None else adapters.apply_adapter(base, adapter, "causal-lm")
    module: torch.nn.Module = model  # (transformers' `to` is typed without its self)
    if not four_bit:  # a 4-bit base was placed as it loaded
        module.to(plan.device)
    checks = probe(module, model_config.vocab_size, device=plan.device)
    if checks.head is None:  # the plain loss holds every position's logits: estimate (and decide) again
        estimate = fit_memory(arch, plan, config, chunked_loss=False, **sizes)
    return Policy(model, checks, use_checkpointing(module, estimate, config), estimate,
                  quantized.describe(plan) if four_bit else None)


def assistant_loss(model: torch.nn.Module, checks: ModelChecks | None, input_ids: torch.Tensor,
                   labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (assistant) tokens (labels not shifted)."""
    targets, select = shifted_targets(labels)
    logprobs = target_logprobs(model, checks, input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, targets=targets, select=select)
    return -logprobs.mean()


def _tokens(example: Example) -> int:
    """Tokens one example puts through the model (both sides of a pair): what /v1's trained_tokens counts."""
    parts = example if isinstance(example, tuple) else (example,)
    return sum(len(part.input_ids) for part in parts)


def _length(example: Example) -> int:
    if isinstance(example, tuple):
        return max(len(part.input_ids) for part in example)
    return len(example.input_ids)
