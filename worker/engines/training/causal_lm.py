"""Train a fresh GPT-2 or continue a causal LM on a text corpus: the causal-LM recipe of the one training loop."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    PretrainedConfig,
    PreTrainedModel,
)

from core.adapters import AdapterConfig
from core.estimate import adapter_sizes, architecture
from core.hyperparams import LMHyperparameters, default
from core.lm_config import DEFAULT_BLOCK_SIZE, resolve_block_size, validate_model_config
from core.paths import GPT2_TOKENIZER_DIR
from worker.engines.device import DevicePlan
from worker.engines.models import manifest as manifests
from worker.engines.models.tokenizers import load_tokenizer_files
from worker.engines.training import adapters, artifacts, quantized
from worker.engines.training import corpus_data as lm_data
from worker.engines.training.loop import (
    RunConfig,
    Setup,
    TrainCallbacks,
    TrainResult,
    fit_memory,
    run,
    use_checkpointing,
)
from worker.engines.training.token_loss import ModelChecks, memory_record, probe, target_logprobs

if TYPE_CHECKING:
    from worker.engines.training.loop_types import TrainedModel

DEFAULT_TOKENIZER = GPT2_TOKENIZER_DIR
MAX_EVAL_BLOCKS = 1024  # evenly spaced validation blocks; keeps each evaluation bounded on big corpora
# exp(100) ~ 2.7e43 is still a finite float (and valid JSON); exp(710) would raise OverflowError.
MAX_PERPLEXITY_LOSS = 100.0


@dataclass(frozen=True, kw_only=True)
class LMTrainConfig(RunConfig):
    """Everything one causal-LM run needs; a fresh GPT-2 when base_model is None.

    train_file is a UTF-8 .txt corpus, or a .jsonl/.csv/.tsv with text_column; without an eval_file the
    last val_fraction of the tokens is held out.
    """

    base_model: str | None = None
    model_config: Mapping[str, int] | None = None  # n_layer, n_embd, n_head, n_positions (fresh models)
    tokenizer: str | None = None  # default: assets/gpt2-tokenizer (fresh) or the base model's own
    text_column: str = "text"
    # Defaults: the hyperparameters model's (core.hyperparams), the one place they live.
    val_fraction: float = default(LMHyperparameters, "val_fraction")
    block_size: int | None = default(LMHyperparameters, "block_size")  # None: min(context length, 256)
    epochs: float = default(LMHyperparameters, "epochs")
    batch_size: int = default(LMHyperparameters, "batch_size")
    learning_rate: float = default(LMHyperparameters, "learning_rate")
    weight_decay: float = default(LMHyperparameters, "weight_decay")
    seed: int = default(LMHyperparameters, "seed")
    adapter: AdapterConfig | None = None  # LoRA on the base model: only the adapter trains and is saved


def train_lm(config: LMTrainConfig, callbacks: TrainCallbacks | None = None) -> TrainResult:
    """Run (or resume) a causal-LM job to completion or cancellation."""
    return run(config, CausalLMRecipe(config), callbacks)


class CausalLMRecipe:
    """One token stream cut into blocks, a GPT-2 (fresh or loaded), next-token loss, perplexity."""

    unit = "tokens"
    adam_betas = (0.9, 0.95)  # GPT-3 / nanoGPT: a shorter second-moment memory is steadier for LM training

    def __init__(self, config: LMTrainConfig) -> None:
        self.config = config
        self.architecture = _check_config(config)  # fail before loading anything
        self.shardable = not (config.adapter and config.adapter.quantize_base)  # a 4-bit base is never sharded

    def build(self, plan: DevicePlan) -> Setup:
        """Tokenize the corpus into blocks, then build (or load) the model if its estimate fits this device."""
        config = self.config
        self.plan = plan
        self.tokenizer_source = _tokenizer_source(config)
        self.tokenizer = load_tokenizer_files(self.tokenizer_source)
        self.model_config = _model_config(config, self.tokenizer, self.architecture)
        self.context = _context_length(self.model_config)
        # A model that states no context length gets the requested block size unchecked.
        self.block_size = (resolve_block_size(config.block_size, self.context) if self.context
                           else config.block_size or DEFAULT_BLOCK_SIZE)
        self.train_set, self.eval_set = _prepare_data(config, self.tokenizer, self.block_size,
                                                      self.model_config.vocab_size)
        self.eval_order = lm_data.eval_indices(len(self.eval_set), MAX_EVAL_BLOCKS)
        arch = architecture(self.model_config.to_dict())
        sizes: dict[str, Any] = {"head": "causal-lm", "batch_size": config.batch_size, "seq_len": self.block_size,
                                 **adapter_sizes(arch, config.adapter)}
        estimate = fit_memory(arch, plan, config, chunked_loss=True, **sizes)
        four_bit = bool(config.adapter and config.adapter.quantize_base)  # an adapter has a base_model (checked)
        self.model: TrainedModel = (quantized.load_quantized(config.base_model, self.model_config, plan)
                                    if four_bit and config.base_model is not None else
                                    _build_model(config, self.model_config))
        if config.adapter is not None:
            self.model = adapters.apply_adapter(self.model, config.adapter, "causal-lm")
        module: torch.nn.Module = self.model  # (transformers' `to` is typed without its self)
        if not four_bit:  # a 4-bit base was placed as it loaded
            module.to(plan.device)  # in place for modules
        self.checks = probe(module, self.model_config.vocab_size, device=plan.device)
        if self.checks.head is None:  # the plain loss holds every position's logits: estimate (and decide) again
            estimate = fit_memory(arch, plan, config, chunked_loss=False, **sizes)
        memory = memory_record(self.checks, use_checkpointing(module, estimate, config), estimate,
                               quantized.describe(plan) if four_bit else None)
        adapter = None if config.adapter is None else config.adapter.model_dump()
        accumulation = config.gradient_accumulation_steps
        return Setup(
            model=self.model, num_examples=len(self.train_set), units_per_example=self.block_size,
            identity={"num_train_blocks": len(self.train_set), "block_size": self.block_size,
                      "batch_size": config.batch_size, "gradient_accumulation_steps": accumulation,
                      "seed": config.seed, **({"adapter": adapter} if adapter else {})},
            info={"num_train": len(self.train_set), "num_eval": len(self.eval_order),
                  "num_train_tokens": self.train_set.num_tokens, "block_size": self.block_size,
                  "context_length": self.context},
            hyperparameters={"tokens_per_step": config.batch_size * accumulation * self.block_size,
                             "block_size": self.block_size, "adapter": adapter, "memory": memory},
        )

    def epoch_steps(self, epoch: int) -> list[list[np.ndarray]]:
        """Blocks in a seeded random order."""
        config = self.config
        return lm_data.epoch_steps(len(self.train_set), config.batch_size, config.gradient_accumulation_steps,
                                   config.seed, epoch)

    def loss(self, model: torch.nn.Module, micro_batch: np.ndarray) -> torch.Tensor:
        """Mean next-token loss over the blocks (all hold block_size targets, so the mean is per token)."""
        inputs, targets = (t.to(self.plan.device) for t in self.train_set.batch(micro_batch))
        return next_token_loss(model, inputs, targets, self.checks)

    def evaluate(self) -> dict[str, float]:
        """Mean next-token loss over the chosen validation blocks and its perplexity."""
        loss_sum = 0.0
        batch_size = self.config.batch_size
        for start in range(0, len(self.eval_order), batch_size):
            chosen = self.eval_order[start:start + batch_size]
            inputs, targets = (t.to(self.plan.device) for t in self.eval_set.batch(chosen))
            loss_sum += next_token_loss(self.model, inputs, targets, self.checks).item() * len(chosen)
        loss = loss_sum / max(len(self.eval_order), 1)
        return {"eval_loss": loss, "perplexity": math.exp(min(loss, MAX_PERPLEXITY_LOSS))}

    def save(self, metrics: dict[str, float], hyperparameters: dict[str, Any], plan: DevicePlan) -> dict[str, Any]:
        """save_pretrained model and tokenizer, with a manifest that carries the architecture and data."""
        config = self.config
        manifest = manifests.build_manifest(
            task="causal-lm", base_model=config.base_model,
            base_model_name=config.base_model_name or config.base_model or "gpt2 (fresh)",
            hyperparameters=hyperparameters, dataset_hashes=dict(config.dataset_hashes), metrics=metrics, plan=plan,
        )
        manifest["model_config"] = _architecture(self.model_config, self.context)
        manifest["tokenizer"] = self.tokenizer_source
        manifest["context_length"] = self.context
        if config.adapter is not None:
            manifest["adapter"] = adapters.adapter_summary(self.model, config.adapter)
        blocks = len(self.eval_order)
        manifest["data"] = {"text_column": config.text_column, "val_fraction": config.val_fraction,
                            "held_out": config.eval_file is None, "block_size": self.block_size,
                            "num_train_blocks": len(self.train_set), "num_train_tokens": self.train_set.num_tokens,
                            "num_eval_blocks": blocks, "num_eval_tokens": blocks * self.block_size}
        artifacts.save_final(config.output_dir, self.model, self.tokenizer, manifest,
                             merged=bool(config.adapter and config.adapter.merge))
        return manifest


def next_token_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                    checks: ModelChecks | None = None) -> torch.Tensor:
    """Mean cross-entropy of predicting `targets` (inputs shifted by one) from `inputs`: through the chunked output
    layer with checks (training/token_loss.py), else the model's own fp32 logits."""
    # Targets are already shifted, so the model's own `labels=` path (which shifts again) is not used.
    select = torch.ones_like(targets, dtype=torch.bool)
    return -target_logprobs(model, checks, input_ids=inputs, targets=targets, select=select).mean()


def _check_config(config: LMTrainConfig) -> dict[str, int] | None:
    """Validate what needs no files; returns the fresh model's architecture (None with a base model)."""
    if config.block_size is not None and config.block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {config.block_size}")
    if config.eval_file is None and not 0.0 < config.val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1) when there is no eval_file, got {config.val_fraction}")
    if config.adapter is not None and config.base_model is None:
        raise ValueError("an adapter trains on top of a base_model; a fresh model trains in full")
    if config.base_model is not None:
        if config.model_config:
            raise ValueError("model_config describes a fresh model; leave it empty when continuing a base_model")
        return None
    architecture = validate_model_config(config.model_config or {})
    resolve_block_size(config.block_size, architecture["n_positions"])  # fail before loading anything
    return architecture


def _tokenizer_source(config: LMTrainConfig) -> str:
    if config.tokenizer is not None:
        return str(config.tokenizer)
    if config.base_model is not None:
        return config.base_model
    if not DEFAULT_TOKENIZER.is_dir():
        raise ValueError(f"the default GPT-2 tokenizer folder {DEFAULT_TOKENIZER} is missing; pass `tokenizer`")
    return str(DEFAULT_TOKENIZER)


def _model_config(config: LMTrainConfig, tokenizer, architecture: dict[str, int] | None) -> PretrainedConfig:
    if architecture is None:
        if config.base_model is None:
            raise ValueError("a causal-LM run needs either base_model (continue it) or architecture (a fresh one)")
        return AutoConfig.from_pretrained(config.base_model, trust_remote_code=False)
    eos = tokenizer.eos_token_id
    # len(tokenizer) counts added special tokens too, so every id the tokenizer can emit has a row.
    sizes: dict[str, Any] = dict(architecture)
    return GPT2Config(vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos, **sizes)


def _context_length(model_config: PretrainedConfig) -> int | None:
    # GPT-2 calls it n_positions (aliased to max_position_embeddings); most other families use the alias.
    value = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", None)
    return int(value) if value else None


def _prepare_data(config: LMTrainConfig, tokenizer, block_size: int,
                  vocab_size: int) -> tuple[lm_data.Blocks, lm_data.Blocks]:
    tokens = lm_data.tokenize(tokenizer, lm_data.read_documents(config.train_file, config.text_column))
    if config.eval_file is None:
        train_set, eval_set = lm_data.split_blocks(tokens, block_size, config.val_fraction)
        hint = "add text, lower block_size or raise val_fraction"
    else:
        eval_tokens = lm_data.tokenize(tokenizer, lm_data.read_documents(config.eval_file, config.text_column))
        train_set, eval_set = lm_data.Blocks(tokens, block_size), lm_data.Blocks(eval_tokens, block_size)
        hint = "add text or lower block_size"
    lm_data.require_blocks(train_set, "training text", hint)
    lm_data.require_blocks(eval_set, "validation text", hint)
    for blocks in (train_set, eval_set):
        if blocks.tokens.max() >= vocab_size:
            raise ValueError(f"the tokenizer emits id {int(blocks.tokens.max())} but the model has only "
                             f"{vocab_size} embeddings; use the model's own tokenizer")
    return train_set, eval_set


def _build_model(config: LMTrainConfig, model_config: PretrainedConfig) -> PreTrainedModel:
    if config.base_model is None:
        return GPT2LMHeadModel(model_config)  # initialised from the seeded torch RNG
    # Weights load in fp32 (the default): the optimizer keeps fp32 masters and autocast does the rest.
    return AutoModelForCausalLM.from_pretrained(config.base_model, config=model_config,
                                                trust_remote_code=False, use_safetensors=True)  # never unpickle .bin


def _architecture(model_config: PretrainedConfig, context: int | None) -> dict[str, Any]:
    # Standard names that PretrainedConfig maps to each family's own (GPT-2: n_layer, n_embd, n_head).
    return {"model_type": model_config.model_type, "vocab_size": model_config.vocab_size,
            "n_layer": getattr(model_config, "num_hidden_layers", None),
            "n_embd": getattr(model_config, "hidden_size", None),
            "n_head": getattr(model_config, "num_attention_heads", None), "n_positions": context}
