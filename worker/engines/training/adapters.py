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
    """The model with a fresh LoRA adapter (from the seeded torch RNG); only the adapter (and a new head) trains.

    Over some mixtures of experts (Mixtral, Qwen3-MoE), "all-linear" also adapts the experts' fused weights and the
    router (PEFT's target_parameters), which PEFT trains without dropout: there the adapter's dropout is 0, and the
    manifest says so.
    """
    if adapter.dropout and _has_fused_experts(model) and _dropout_refused(model, adapter, task):
        adapter = adapter.model_copy(update={"dropout": 0.0})
    try:
        return get_peft_model(model, lora_config(adapter, task))
    except ValueError as exc:  # PEFT names the modules it could not find
        raise ValueError(f"adapter.target_modules: {exc}") from exc


def _has_fused_experts(model: torch.nn.Module) -> bool:
    """Whether the model keeps its experts as fused 3-D weights (transformers 5's MoE blocks: Mixtral, Qwen3-MoE,
    gpt-oss), which PEFT's "all-linear" adapts as parameters."""
    return any(type(module).__name__.endswith("Experts") and any(p.dim() == 3 for p in module.parameters(False))
               for module in model.modules())


def _dropout_refused(model: torch.nn.Module, adapter: AdapterConfig, task: str) -> bool:
    """Whether PEFT adapts some of the model's weights as parameters, which it refuses to do with dropout: asked of
    a weightless (meta) copy of the architecture, so the model itself is never half-wrapped."""
    from transformers import AutoModelForCausalLM

    config = getattr(model, "config", None)
    if config is None or task != TaskKind.CAUSAL_LM:
        return False
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    try:
        get_peft_model(skeleton, lora_config(adapter, task))
    except ValueError as exc:
        return "lora_dropout != 0" in str(exc)
    return False


def adapter_summary(model: torch.nn.Module, adapter: AdapterConfig) -> dict[str, Any]:
    """The manifest's `adapter` entry: settings, resolved target modules and sizes."""
    if not isinstance(model, PeftModel):
        raise TypeError(f"an adapter summary needs a PEFT model, got {type(model).__name__}")
    config = model.peft_config["default"]
    assert isinstance(config, LoraConfig)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    # q_proj, not its full path; experts' fused weights (target_parameters) as experts.gate_up_proj
    parameters = getattr(config, "target_parameters", None) or ()
    resolved = sorted({name.rsplit(".", 1)[-1] for name in config.target_modules or ()}
                      | {".".join(name.rsplit(".", 2)[-2:]) for name in parameters})
    return {**adapter.model_dump(), "dropout": config.lora_dropout, "target_modules_resolved": resolved,
            "trainable_parameters": trainable, "total_parameters": total}


def save_adapter(output_dir: Path, model: PeftModel, tokenizer: Any, manifest: dict[str, Any]) -> Path:
    """The adapter folder (PEFT's files), the tokenizer and the manifest (written last, as the completion mark)."""
    return artifacts.save_final(output_dir, model, tokenizer, manifest)
