"""LoRA adapters through PEFT: wrap a model, checkpoint only what trains, save the adapter folder, merge on request.

A LoRA job's model is the base model (frozen, never copied) plus the adapter: for each targeted linear layer W,
trainable A (r x in) and B (out x r, zero at the start, so training starts from the base exactly) and the forward
W x + B A x * alpha / r. The optimizer sees the adapter only (the loop's AdamW takes the parameters that require
grad), a checkpoint holds the adapter only (worker.engines.training.artifacts), and the artifact is PEFT's own folder
(adapter_config.json, adapter_model.safetensors) with the tokenizer and the manifest, which
`PeftModel.from_pretrained(base, folder)` loads. A classification job also trains (and saves) its new head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from transformers import PreTrainedModel

from core.adapters import ALL_LINEAR, AdapterConfig
from core.vocab import TaskKind
from worker.engines.training import artifacts

TASK_TYPES = {TaskKind.CAUSAL_LM: TaskType.CAUSAL_LM, TaskKind.TEXT_CLASSIFICATION: TaskType.SEQ_CLS}


def lora_config(adapter: AdapterConfig, task: str) -> LoraConfig:
    """PEFT's LoraConfig for an adapter of a causal-LM or classification job."""
    if task not in TASK_TYPES:
        raise ValueError(f"adapters train {' and '.join(TASK_TYPES)} models, not {task!r}")
    targets: str | list[str] = ALL_LINEAR if adapter.target_modules == ALL_LINEAR else list(adapter.target_modules)
    # PEFT scales by lora_alpha / r in floats; its annotation says int, the spec allows a float alpha.
    return LoraConfig(task_type=TASK_TYPES[TaskKind(task)], r=adapter.r, lora_alpha=adapter.alpha,  # type: ignore[arg-type]
                      lora_dropout=adapter.dropout, target_modules=targets, bias="none")


def apply_adapter(model: PreTrainedModel, adapter: AdapterConfig, task: str) -> PeftModel:
    """The model with a fresh LoRA adapter (from the seeded torch RNG); only the adapter (and a new head) trains."""
    try:
        return get_peft_model(model, lora_config(adapter, task))
    except ValueError as exc:  # PEFT names the modules it could not find
        raise ValueError(f"adapter.target_modules: {exc}") from exc


def adapter_summary(model: torch.nn.Module, adapter: AdapterConfig) -> dict[str, Any]:
    """The manifest's `adapter` entry: settings, resolved target modules and sizes."""
    if not isinstance(model, PeftModel):
        raise TypeError(f"an adapter summary needs a PEFT model, got {type(model).__name__}")
    config = model.peft_config["default"]
    assert isinstance(config, LoraConfig)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    resolved = sorted({name.rsplit(".", 1)[-1] for name in config.target_modules or ()})  # q_proj, not its full path
    return {**adapter.model_dump(), "target_modules_resolved": resolved,
            "trainable_parameters": trainable, "total_parameters": total}


def save_adapter(output_dir: Path, model: PeftModel, tokenizer: Any, manifest: dict[str, Any]) -> Path:
    """The adapter folder (PEFT's files), the tokenizer and the manifest (written last, as the completion mark)."""
    return artifacts.save_final(output_dir, model, tokenizer, manifest)
