"""PEFT LoRA adapter folders over a tiny base, each with an effect of its own, and HF + PEFT greedy references."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from core.adapters import AdapterConfig

ADAPTERS = {"wide": AdapterConfig(r=4, alpha=8, target_modules="all-linear"),
            "narrow": AdapterConfig(r=2, alpha=6, target_modules=["q_proj", "v_proj", "down_proj"])}


def make_adapters(base: Path, root: Path, configs: dict[str, AdapterConfig] = ADAPTERS) -> dict[str, Path]:
    """PEFT adapter folders root/<name> over `base`, each with a random B (PEFT starts B at zero: no effect)."""
    from worker.engines.training import adapters

    folders = {}
    for seed, (name, config) in enumerate(configs.items()):
        torch.manual_seed(seed + 10)
        model = adapters.apply_adapter(AutoModelForCausalLM.from_pretrained(base), config, "causal-lm")
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.normal_(0, 0.3)
        model.save_pretrained(root / name)
        folders[name] = root / name
    return folders


def peft_model(base: Path, folder: Path | None):
    """HF's model of `base`, with PEFT's adapter from `folder` on top when given (eval mode)."""
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    return model if folder is None else PeftModel.from_pretrained(model, str(folder)).eval()


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """HF `generate`'s greedy continuation of one prompt (new token ids only)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(ids):].tolist()
