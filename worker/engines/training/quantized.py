"""QLoRA's base: a causal LM whose frozen linear layers hold 4-bit NormalFloat weights (bitsandbytes), under an
adapter that trains in fp32.

Each linear layer of the blocks becomes bitsandbytes' Linear4bit: its weight packed two to a byte, one 8-bit absmax
per block of 64 weights and (double quantization) one fp32 scale per 256 absmax values, 4.127 bits a weight
(core.estimate.NF4_BYTES). A forward dequantizes the matrix to the compute dtype (the run's autocast dtype, else
fp32), multiplies and drops it; backward dequantizes it again from the saved 4-bit weight. The embeddings, norms and
the output layer stay as loaded, so the chunked loss reads a plain output head (token_loss.probe) and packing and
gradient checkpointing work as on a full-precision base. The adapter's A and B are fp32 (PEFT's default on a 4-bit
layer): only they get gradients and AdamW states.

Where it runs: bitsandbytes on both CUDA (its kernels) and CPU (0.49+: a native backend, and PyTorch ops where a
kernel is missing), measured to train here with torch 2.13; torchao's NF4 is not needed.

What leaves the run is full precision: the adapter folder is an ordinary PEFT adapter for the full-precision base
(adapter_config.json names it), and a merged copy folds the adapter into the base's original weights, loaded again
from its folder (artifacts.save_final), never into weights dequantized from 4 bits.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PretrainedConfig, PreTrainedModel

from worker.engines.device import DevicePlan

BACKEND = "bitsandbytes"


def nf4_config(plan: DevicePlan) -> BitsAndBytesConfig:
    """4-bit NF4 with double quantization, dequantized to the plan's compute dtype (fp32 without autocast)."""
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=plan.autocast_dtype or torch.float32)


def load_quantized(source: str, model_config: PretrainedConfig, plan: DevicePlan) -> PreTrainedModel:
    """The causal LM at `source` on plan.device with its linear layers in NF4 (the output layer kept as loaded).

    Placed by the loader, not moved afterwards: bitsandbytes quantizes each weight as it reaches the device.
    """
    model = AutoModelForCausalLM.from_pretrained(source, config=model_config, trust_remote_code=False,
                                                 use_safetensors=True, quantization_config=nf4_config(plan),
                                                 device_map={"": plan.device})
    for module in model.modules():
        # On a CPU with AVX512-BF16, bitsandbytes 0.50 repacks a layer's weight in place the first time it runs in
        # eval mode without gradients (an evaluation, the probe), into a layout only its inference kernel reads:
        # later training forwards then skip the autograd function, and the layer passes no gradient to its input.
        # It also refuses layers narrower than a block (64). Training keeps the one layout.
        if hasattr(module, "support_avx512bf16_for_cpu"):
            setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010 - a plain attribute, not a submodule
    return model


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether a model (or the base under a PEFT wrapper) holds 4-bit weights."""
    return any(type(module).__name__ == "Linear4bit" for module in model.modules())


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights as held, a 4-bit layer's quantization state (absmax, scales, code tables)
    included; a tensor several layers share (a code table) counted once."""
    held: dict[int, int] = {}
    for parameter in model.parameters():
        tensors = [parameter]
        state = getattr(parameter, "quant_state", None)
        while state is not None:  # double quantization nests a second state for the absmax values
            tensors += [t for t in (state.absmax, state.code) if t is not None]
            state = state.state2 if getattr(state, "nested", False) else None
        held.update((t.data_ptr(), t.numel() * t.element_size()) for t in tensors)
    return sum(held.values())


def describe(plan: DevicePlan) -> dict[str, Any]:
    """The manifest's record of the base's precision (hyperparameters.memory.quantized_base)."""
    from importlib.metadata import version

    dtype = plan.autocast_dtype or torch.float32
    return {"format": "nf4", "double_quantization": True, "backend": f"{BACKEND} {version(BACKEND)}",
            "compute_dtype": str(dtype).removeprefix("torch.")}
