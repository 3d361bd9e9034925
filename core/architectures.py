"""The decoder architectures the generation engine serves, told apart by config.json's `model_type`.

Import-light on purpose: the API refuses an unsupported model by reading config.json, without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# GPT-2 has its own runner; the rest share one (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU).
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
SERVED_MODEL_TYPES = ("gpt2", *LLAMA_FAMILY)


def unsupported_reason(config: Mapping[str, Any]) -> str | None:
    """Why a model with this config.json cannot be served, or None when its model_type is one the engine runs."""
    model_type = config.get("model_type")
    if model_type in SERVED_MODEL_TYPES:
        return None
    return (f"model_type {model_type!r} is not supported for generation; "
            f"the engine serves {', '.join(SERVED_MODEL_TYPES)}")
