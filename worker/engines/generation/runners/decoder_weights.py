"""Llama-family weights (llama, mistral, qwen2, qwen3) for serving, read straight from safetensors.

As for GPT-2 (gpt2_weights), no HF model class is imported: each layer's q/k/v projections are joined into
one [q + 2 kv, hidden] matrix and gate/up into one [2 intermediate, hidden] matrix, so a layer is four
matmuls, packed once for oneDNN on a CPU. The rotary frequencies come from transformers' own
ROPE_INIT_FUNCTIONS (linear, llama3, yarn; the default is the model class's own formula), so every scaling type
computes exactly as HF's does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from core.architectures import LLAMA_FAMILY
from worker.engines.device import DevicePlan, pack_linear
from worker.engines.generation.runners.gpt2_weights import (
    ACTIVATIONS,
    eos_ids,
    map_tensors,
    resolve_folder,
    safetensors_files,
)

# "dynamic" NTK scaling only changes the frequencies past the original context, which the engine never
# serves (context_length stays at it), so below it the frequencies are the default ones, exactly as in HF.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclass
class DecoderLayer:
    """One block's weights: projections [out, in] (oneDNN-packed on a CPU when it can be) and norms."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None  # qwen3: RMSNorm of each query and key head before the rotation
    k_norm: torch.Tensor | None
    window: int | None  # sliding-window attention: a query sees the last `window` positions, itself included


@dataclass
class DecoderWeights:
    """A llama-family checkpoint's shapes, rotary frequencies, eos ids and weights in the compute dtype."""

    config: PretrainedConfig
    eos_token_ids: frozenset[int]
    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    act: str
    context_length: int
    inv_freq: torch.Tensor  # [head_dim / 2] fp32
    rope_scale: float  # yarn's attention factor, applied to cos and sin as HF does
    embed: torch.Tensor
    head: torch.Tensor
    norm: torch.Tensor
    layers: list[DecoderLayer] = field(default_factory=list)


def load_decoder(model: str | Path, plan: DevicePlan, *, pack: bool = True) -> DecoderWeights:
    """Config and weights of a llama/mistral/qwen2/qwen3 safetensors checkpoint on the plan's device and dtype."""
    folder = resolve_folder(model)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)  # checked before any weight is read
    if config.model_type not in LLAMA_FAMILY:
        raise ValueError(f"{model}: model_type {config.model_type!r} is not a llama-family decoder")
    if config.hidden_act not in ACTIVATIONS:
        raise ValueError(f"{model}: activation {config.hidden_act!r} is not supported")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{model}: rope_parameters type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    inv_freq, rope_scale = _rotary_frequencies(config, rope, rope_type)
    context = config.max_position_embeddings
    if rope_type == "dynamic":
        context = rope.get("original_max_position_embeddings") or context
    tensors = {name: tensor for file in safetensors_files(folder) for name, (tensor, _) in map_tensors(file).items()}
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or \
        config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = plan.autocast_dtype or torch.float32
    device = torch.device(plan.device)
    packing = pack and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)

    def get(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"{model}: the checkpoint lacks {name}")
        return tensors[name].to(device=device, dtype=dtype)

    def matrix(*names: str) -> torch.Tensor:
        joined = torch.cat([get(n) for n in names]) if len(names) > 1 else get(names[0])
        return pack_linear(joined) if packing else joined

    def bias(*names: str) -> torch.Tensor | None:
        if not any(f"{n}.bias" in tensors for n in names):
            return None
        return torch.cat([get(f"{n}.bias") if f"{n}.bias" in tensors else
                          torch.zeros(get(f"{n}.weight").shape[0], dtype=dtype, device=device) for n in names])

    embed = get("model.embed_tokens.weight")
    tied = "lm_head.weight" not in tensors or bool(getattr(config, "tie_word_embeddings", False))
    head = pack_linear(embed) if packing else embed
    if not tied:
        head = matrix("lm_head.weight")
    layer_types = getattr(config, "layer_types", None)
    weights = DecoderWeights(
        config=config, eos_token_ids=eos_ids(folder, config), dtype=dtype, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, eps=config.rms_norm_eps, act=config.hidden_act, context_length=context,
        inv_freq=inv_freq.float(), rope_scale=float(rope_scale), embed=embed, head=head,
        norm=get("model.norm.weight"))
    for index in range(config.num_hidden_layers):
        prefix = f"model.layers.{index}"
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        qkv = [f"{attn}.{p}_proj" for p in "qkv"]
        has_norm = f"{attn}.q_norm.weight" in tensors
        weights.layers.append(DecoderLayer(
            qkv=matrix(*(f"{n}.weight" for n in qkv)), qkv_bias=bias(*qkv),
            o=matrix(f"{attn}.o_proj.weight"), o_bias=bias(f"{attn}.o_proj"),
            gate_up=matrix(f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"), down=matrix(f"{mlp}.down_proj.weight"),
            input_norm=get(f"{prefix}.input_layernorm.weight"),
            post_norm=get(f"{prefix}.post_attention_layernorm.weight"),
            q_norm=get(f"{attn}.q_norm.weight") if has_norm else None,
            k_norm=get(f"{attn}.k_norm.weight") if has_norm else None,
            window=_window(config, index, layer_types)))
        if bias(f"{mlp}.gate_proj", f"{mlp}.up_proj", f"{mlp}.down_proj") is not None:
            raise ValueError(f"{model}: MLP biases (mlp_bias) are not supported")
    return weights


def _rotary_frequencies(config: PretrainedConfig, rope: dict, rope_type: str) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [head_dim / 2] and the cos/sin factor, as the model's rotary embedding computes them:
    transformers' ROPE_INIT_FUNCTIONS for scaled types, its default (the model class's own) otherwise."""
    if rope_type in ("default", "dynamic"):
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = rope["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))


def _window(config: PretrainedConfig, index: int, layer_types: list[str] | None) -> int | None:
    """The sliding window of layer `index`, as HF's attention for this model type applies it."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if layer_types is not None:  # qwen2/qwen3: use_sliding_window and max_window_layers became layer_types
        return window if layer_types[index] == "sliding_attention" else None
    return window if config.model_type == "mistral" else None

