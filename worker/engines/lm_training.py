"""Train a fresh GPT-2 or continue a causal LM on a text corpus: the classifier's loop, next-token loss."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    PretrainedConfig,
    PreTrainedModel,
)

from core.lm_config import DEFAULT_BLOCK_SIZE, resolve_block_size, validate_model_config
from core.paths import GPT2_TOKENIZER_DIR
from worker.engines import artifacts, data, lm_data
from worker.engines.device import DevicePlan, resolve_device
from worker.engines.training import (
    MAX_GRAD_NORM,
    Progress,
    TrainCallbacks,
    TrainResult,
    build_adamw,
    lr_at,
    run_steps,
    seed_everything,
)

DEFAULT_TOKENIZER = GPT2_TOKENIZER_DIR
MAX_EVAL_BLOCKS = 1024  # evenly spaced validation blocks; keeps each evaluation bounded on big corpora
# exp(100) ~ 2.7e43 is still a finite float (and valid JSON); exp(710) would raise OverflowError.
MAX_PERPLEXITY_LOSS = 100.0
ADAM_BETAS = (0.9, 0.95)  # GPT-3 / nanoGPT: a shorter second-moment memory is steadier for LM training


@dataclass(frozen=True)
class LMTrainConfig:
    """Everything one causal-LM run needs; a fresh GPT-2 when base_model is None."""

    train_file: Path  # a UTF-8 .txt corpus, or a .jsonl/.csv/.tsv with text_column
    eval_file: Path | None  # None: hold out the last val_fraction of the tokens
    output_dir: Path
    checkpoint_dir: Path
    base_model: str | None = None
    model_config: Mapping[str, int] | None = None  # n_layer, n_embd, n_head, n_positions (fresh models)
    tokenizer: str | None = None  # default: assets/gpt2-tokenizer (fresh) or the base model's own
    text_column: str = "text"
    val_fraction: float = 0.1
    block_size: int | None = None  # default min(context length, 256)
    epochs: float = 1.0
    max_steps: int | None = None
    batch_size: int = 8
    learning_rate: float = 3e-4
    warmup_ratio: float = 0.0
    weight_decay: float = 0.1
    gradient_accumulation_steps: int = 1
    precision: str = "auto"
    seed: int = 42
    eval_steps: int | None = None
    checkpoint_steps: int | None = None
    device: str = "auto"
    base_model_name: str = ""
    dataset_hashes: Mapping[str, str] = field(default_factory=dict)


def train_lm(config: LMTrainConfig, callbacks: TrainCallbacks | None = None) -> TrainResult:
    """Run (or resume) a causal-LM job to completion or cancellation."""
    callbacks = callbacks or TrainCallbacks()
    architecture = _check_config(config)
    plan = resolve_device(config.device, config.precision)
    seed_everything(config.seed)

    tokenizer_source = _tokenizer_source(config)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    model_config = _model_config(config, tokenizer, architecture)
    context = _context_length(model_config)
    # A model that states no context length gets the requested block size unchecked.
    block_size = (resolve_block_size(config.block_size, context) if context
                  else config.block_size or DEFAULT_BLOCK_SIZE)
    train_set, eval_set = _prepare_data(config, tokenizer, block_size, model_config.vocab_size)
    model = _build_model(config, model_config)
    model.to(plan.device)  # in place for modules
    optimizer = _build_optimizer(model, config, plan)
    scaler = plan.grad_scaler()

    accumulation = config.gradient_accumulation_steps
    per_epoch = data.steps_per_epoch(len(train_set), config.batch_size, accumulation)
    total_steps = config.max_steps or math.ceil(config.epochs * per_epoch)
    warmup_steps = math.ceil(config.warmup_ratio * total_steps)
    eval_order = lm_data.eval_indices(len(eval_set), MAX_EVAL_BLOCKS)
    identity = {"num_train_blocks": len(train_set), "block_size": block_size, "batch_size": config.batch_size,
                "gradient_accumulation_steps": accumulation, "seed": config.seed}

    progress, resumed_from = Progress("tokens"), None
    checkpoint = artifacts.latest_checkpoint(config.checkpoint_dir)
    if checkpoint is not None:
        progress = _resume(checkpoint, model, optimizer, scaler, plan, identity)
        resumed_from = progress.step
        callbacks.on_event("resumed", f"resumed from {checkpoint.name} at step {progress.step}")
    callbacks.on_start({
        "total_steps": total_steps, "steps_per_epoch": per_epoch, "warmup_steps": warmup_steps,
        "num_train": len(train_set), "num_eval": len(eval_order), "num_train_tokens": train_set.num_tokens,
        "block_size": block_size, "context_length": context, "device": plan.device,
        "precision": plan.precision, "resumed_from_step": resumed_from,
    })

    def run_eval() -> dict[str, float]:
        return evaluate(model, eval_set, eval_order, plan, config.batch_size)

    def save(step: int) -> None:
        state = dict(identity, loss_sum=progress.loss_sum, tokens=progress.units, runtime=progress.runtime)
        path = artifacts.save_checkpoint(config.checkpoint_dir, step, model, optimizer, scaler, plan, state)
        callbacks.on_checkpoint(step, path)

    def cancelled() -> TrainResult:
        callbacks.on_event("cancelled", f"stopped at step {progress.step} of {total_steps}")
        return TrainResult("cancelled", progress.step, total_steps, progress.metrics(), None, {})

    if callbacks.should_stop():  # cancelled while loading: nothing new to checkpoint
        return cancelled()

    completed = run_steps(
        progress=progress, total_steps=total_steps, per_epoch=per_epoch,
        epoch_steps=lambda epoch: lm_data.epoch_steps(len(train_set), config.batch_size, accumulation,
                                                      config.seed, epoch),
        step=lambda micro_batches, lr: _train_step(model, optimizer, scaler, plan, train_set, micro_batches, lr),
        learning_rate=lambda step: lr_at(step, total_steps, warmup_steps, config.learning_rate),
        evaluate_now=run_eval, eval_steps=config.eval_steps, checkpoint_steps=config.checkpoint_steps, save=save,
        optimizer=optimizer, plan=plan, callbacks=callbacks)
    if not completed:
        return cancelled()

    metrics = progress.metrics()
    eval_metrics = run_eval()
    callbacks.on_eval(progress.step, eval_metrics)
    metrics.update(eval_metrics)
    manifest = artifacts.build_manifest(
        task="causal-lm", base_model=config.base_model,
        base_model_name=config.base_model_name or config.base_model or "gpt2 (fresh)",
        hyperparameters=_hyperparameters(config, plan, total_steps, per_epoch, warmup_steps, block_size),
        dataset_hashes=dict(config.dataset_hashes), metrics=metrics, plan=plan,
    )
    manifest["model_config"] = _architecture(model_config, context)
    manifest["tokenizer"] = tokenizer_source
    manifest["context_length"] = context
    manifest["data"] = {"text_column": config.text_column, "val_fraction": config.val_fraction,
                        "held_out": config.eval_file is None, "block_size": block_size,
                        "num_train_blocks": len(train_set), "num_train_tokens": train_set.num_tokens,
                        "num_eval_blocks": len(eval_order), "num_eval_tokens": len(eval_order) * block_size}
    artifacts.save_final(config.output_dir, model, tokenizer, manifest)
    callbacks.on_event("saved", f"model saved to {config.output_dir}")
    return TrainResult("completed", progress.step, total_steps, metrics, Path(config.output_dir), manifest)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                plan: DevicePlan, train_set: lm_data.Blocks, micro_batches: list[np.ndarray],
                lr: float) -> tuple[float, float, int]:
    """One optimizer step over its micro-batches; returns (mean loss, grad norm, target tokens)."""
    model.train()
    for group in optimizer.param_groups:
        group["lr"] = lr
    blocks = sum(len(indices) for indices in micro_batches)
    step_loss = torch.zeros((), device=plan.device)
    for indices in micro_batches:
        inputs, targets = (t.to(plan.device) for t in train_set.batch(indices))
        with plan.autocast():
            loss = next_token_loss(model, inputs, targets)
        # All blocks hold the same number of tokens, so weighting by the share of blocks makes the
        # step's gradient the mean over all its tokens, as one large batch would (the last may be short).
        share = loss * (len(indices) / blocks)
        scaler.scale(share).backward()
        step_loss += share.detach().float()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return step_loss.item(), float(grad_norm), blocks * train_set.block_size


def next_token_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting `targets` (inputs shifted by one) from `inputs`."""
    # Targets are already shifted, so the model's own `labels=` path (which shifts again) is not used;
    # no cache is wanted while training. Logits go to fp32 because softmax over 50k classes in bf16 is lossy.
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def evaluate(model: torch.nn.Module, eval_set: lm_data.Blocks, indices: np.ndarray, plan: DevicePlan,
             batch_size: int) -> dict[str, float]:
    """Mean next-token loss over the chosen validation blocks and its perplexity."""
    model.eval()
    loss_sum = 0.0
    with torch.inference_mode(), plan.autocast():
        for start in range(0, len(indices), batch_size):
            chosen = indices[start:start + batch_size]
            inputs, targets = (t.to(plan.device) for t in eval_set.batch(chosen))
            loss_sum += next_token_loss(model, inputs, targets).item() * len(chosen)
    loss = loss_sum / max(len(indices), 1)
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, MAX_PERPLEXITY_LOSS))}


def _check_config(config: LMTrainConfig) -> dict[str, int] | None:
    """Validate what needs no files; returns the fresh model's architecture (None with a base model)."""
    at_least_one = {"batch_size": config.batch_size, "gradient_accumulation_steps": config.gradient_accumulation_steps,
                    "max_steps": config.max_steps, "eval_steps": config.eval_steps,
                    "checkpoint_steps": config.checkpoint_steps, "block_size": config.block_size}
    for name, value in at_least_one.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if config.max_steps is None and not config.epochs > 0:
        raise ValueError(f"epochs must be positive, got {config.epochs}")
    if not 0.0 <= config.warmup_ratio < 1.0:
        raise ValueError(f"warmup_ratio must be in [0, 1), got {config.warmup_ratio}")
    if config.eval_file is None and not 0.0 < config.val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1) when there is no eval_file, got {config.val_fraction}")
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
        return AutoConfig.from_pretrained(config.base_model, trust_remote_code=False)
    eos = tokenizer.eos_token_id
    # len(tokenizer) counts added special tokens too, so every id the tokenizer can emit has a row.
    return GPT2Config(vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos, **architecture)


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


def _build_optimizer(model: torch.nn.Module, config: LMTrainConfig, plan: DevicePlan) -> torch.optim.Optimizer:
    # As nanoGPT: every matrix decays, embeddings included (GPT-2 ties wte to the LM head, so they are one
    # matrix); biases and LayerNorm weights (the 1-D parameters) do not.
    return build_adamw(model, learning_rate=config.learning_rate, weight_decay=config.weight_decay,
                       betas=ADAM_BETAS, plan=plan)


def _resume(checkpoint: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            scaler: torch.amp.GradScaler, plan: DevicePlan, identity: dict[str, Any]) -> Progress:
    state = artifacts.resume_state(checkpoint, model, optimizer, scaler, plan, identity)
    return Progress("tokens", step=state["step"], loss_sum=state["loss_sum"], units=state["tokens"],
                    runtime=state["runtime"])


def _hyperparameters(config: LMTrainConfig, plan: DevicePlan, total_steps: int, per_epoch: int,
                     warmup_steps: int, block_size: int) -> dict[str, Any]:
    return {
        "epochs": total_steps / per_epoch, "max_steps": config.max_steps, "total_steps": total_steps,
        "steps_per_epoch": per_epoch, "batch_size": config.batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "tokens_per_step": config.batch_size * config.gradient_accumulation_steps * block_size,
        "learning_rate": config.learning_rate, "lr_schedule": "linear", "warmup_ratio": config.warmup_ratio,
        "warmup_steps": warmup_steps, "weight_decay": config.weight_decay, "optimizer": "adamw",
        "adam_betas": list(ADAM_BETAS), "max_grad_norm": MAX_GRAD_NORM, "block_size": block_size,
        "precision": plan.precision, "seed": config.seed, "eval_steps": config.eval_steps,
        "checkpoint_steps": config.checkpoint_steps,
    }


def _architecture(model_config: PretrainedConfig, context: int | None) -> dict[str, Any]:
    # Standard names that PretrainedConfig maps to each family's own (GPT-2: n_layer, n_embd, n_head).
    return {"model_type": model_config.model_type, "vocab_size": model_config.vocab_size,
            "n_layer": getattr(model_config, "num_hidden_layers", None),
            "n_embd": getattr(model_config, "hidden_size", None),
            "n_head": getattr(model_config, "num_attention_heads", None), "n_positions": context}
