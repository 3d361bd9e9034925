"""The decoder architectures the generation engine serves, told apart by config.json's `model_type`.

Import-light on purpose: the API refuses an unservable model by reading config.json, without torch.

Three runners (worker/engines/generation/runners/): GPT-2's own, the llama-family one (joined projections and
packed weights), and for every other causal LM transformers defines, the general runner (transformers' own model
over the same paged cache). What none can serve: a model that is not a causal LM (an encoder, a seq2seq model) and
one whose code ships with its checkpoint (`auto_map`: trust_remote_code, which the service never runs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# GPT-2 has its own runner; these share one (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU).
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
SERVED_MODEL_TYPES = ("gpt2", *LLAMA_FAMILY)  # the built-in runners' model types
# transformers' causal-LM head classes end so (GPT2LMHeadModel, LlamaForCausalLM, GptOssForCausalLM, ...).
CAUSAL_LM_CLASSES = ("ForCausalLM", "LMHeadModel")


def unsupported_reason(config: Mapping[str, Any]) -> str | None:
    """Why a model with this config.json cannot be served, or None when a runner serves it."""
    model_type = config.get("model_type")
    if model_type in SERVED_MODEL_TYPES:
        return None
    if not isinstance(model_type, str) or not model_type:
        return "its config.json names no model_type"
    if config.get("auto_map"):
        return (f"model_type {model_type!r} needs the code shipped with its checkpoint (trust_remote_code), "
                f"which the service does not run")
    classes = [name for name in config.get("architectures") or [] if isinstance(name, str)]
    if classes and not any(name.endswith(CAUSAL_LM_CLASSES) for name in classes):
        return (f"model_type {model_type!r} ({', '.join(classes)}) is not a causal language model; "
                f"generation serves causal LMs (a *ForCausalLM or *LMHeadModel class)")
    return None
