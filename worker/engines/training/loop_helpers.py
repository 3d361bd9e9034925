"""The training loop's small pure helpers: the LR schedule, seeding, the optimizer, micro-batch splitting and
the checks made before a run starts."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch

from core.estimate import Architecture, MemoryEstimate, fitting_memory, format_bytes
from worker.engines.device import DevicePlan, device_memory
from worker.engines.training.loop_types import DoesNotFit, RunConfig
from worker.engines.training.sparse_adamw import RowSparseAdamW


def lr_at(step: int, total_steps: int, warmup_steps: int, base_lr: float) -> float:
    """Linear warmup then linear decay to zero; `step` counts optimizer steps already taken."""
    if step < warmup_steps:
        return base_lr * step / max(1, warmup_steps)
    return base_lr * max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) for a reproducible run."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_adamw(model: torch.nn.Module, *, learning_rate: float, weight_decay: float,
                betas: tuple[float, float], plan: DevicePlan) -> torch.optim.Optimizer:
    """AdamW decaying the matrices only: biases and LayerNorm weights (the 1-D parameters) are not decayed."""
    # Weights stay fp32 (as BERT, nanoGPT and HF Trainer): the optimizer keeps fp32 masters, autocast does
    # the rest. Embeddings are matrices and decay too (GPT-2 ties wte to the LM head, so they are one).
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    # The fused kernel updates all parameters in one pass; it exists for CPU and CUDA. Tables with sparse
    # gradients take RowSparseAdamW's row step, with the same result as dense AdamW.
    return RowSparseAdamW(groups, lr=learning_rate, betas=betas, eps=1e-8, fused=plan.device_type in ("cpu", "cuda"))


def fit_memory(arch: Architecture | None, plan: DevicePlan, config: RunConfig, **kwargs: Any) -> MemoryEstimate | None:
    """The run's peak-memory estimate with gradient checkpointing decided (the config's choice, or on only when
    needed: core.estimate.fitting_memory); DoesNotFit, before the model is allocated, when even that exceeds this
    device (or config.memory_limit_bytes). None when the architecture is unknown."""
    if arch is None:
        return None
    capacity = config.memory_limit_bytes or device_memory(plan)
    estimate = fitting_memory(arch, limit=capacity, checkpointing=config.gradient_checkpointing,
                              precision=plan.precision, **kwargs)
    require_fit(estimate, plan, capacity)
    return estimate


def require_fit(estimate: MemoryEstimate, plan: DevicePlan, capacity: int) -> None:
    """Refuse a run whose estimated peak memory exceeds `capacity` bytes of this device."""
    if estimate.total_bytes > capacity:
        raise DoesNotFit(f"this job needs about {estimate.describe()}, more than {plan.device} on this worker "
                         f"has ({format_bytes(capacity)}); lower batch_size (and raise gradient_accumulation_steps "
                         "for the same effective batch) or the sequence length, or use a smaller model")


def use_checkpointing(model: torch.nn.Module, estimate: MemoryEstimate | None, config: RunConfig) -> bool:
    """Turn on gradient checkpointing (non-reentrant, offloaded to host memory when asked) where the estimate
    decided it, or where the config asks and no estimate exists; returns whether it is on."""
    on = estimate.checkpointing if estimate is not None else bool(config.gradient_checkpointing)
    if on:
        enable: Any = getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
        enable(gradient_checkpointing_kwargs={"use_reentrant": False}, offload=config.offload_activations)
    return on


def split_micro_batches(micro_batches: list[Any], split: int) -> list[Any]:
    """Cut every micro-batch into `split` parts: same examples and optimizer step, less memory at a time."""
    if split == 1:
        return micro_batches
    parts: list[Any] = []
    for indices in micro_batches:
        size = math.ceil(len(indices) / split)
        parts.extend(indices[i:i + size] for i in range(0, len(indices), size))
    return parts


def check_config(config: RunConfig) -> None:
    """Refuse a schedule that cannot run (counts below one, no epochs, warmup of the whole run)."""
    at_least_one = {"batch_size": config.batch_size,
                    "gradient_accumulation_steps": config.gradient_accumulation_steps,
                    "max_steps": config.max_steps, "eval_steps": config.eval_steps,
                    "checkpoint_steps": config.checkpoint_steps,
                    "early_stopping_patience": config.early_stopping_patience}
    for name, value in at_least_one.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if config.max_steps is None and not config.epochs > 0:
        raise ValueError(f"epochs must be positive, got {config.epochs}")
    if not 0.0 <= config.warmup_ratio < 1.0:
        raise ValueError(f"warmup_ratio must be in [0, 1), got {config.warmup_ratio}")
    if config.offload_activations and config.gradient_checkpointing is False:
        raise ValueError("offload_activations needs gradient_checkpointing true or None")


def checkpoint_due(step: int, checkpoint_steps: int | None) -> bool:
    """True when a periodic checkpoint follows optimizer step `step` (the loop writes it; the reporter flushes the
    metric history first, so a checkpoint never gets ahead of it)."""
    return checkpoint_steps is not None and step % checkpoint_steps == 0
