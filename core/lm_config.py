"""Architecture of a fresh GPT-2 for causal-LM training: defaults and validation, standard library only."""

from __future__ import annotations

from collections.abc import Mapping

# nanoGPT's "baby GPT" for Shakespeare: small enough to train from scratch on one GPU in minutes.
DEFAULT_MODEL_CONFIG: dict[str, int] = {"n_layer": 6, "n_embd": 384, "n_head": 6, "n_positions": 256}
DEFAULT_BLOCK_SIZE = 256
GPT2_VOCAB_SIZE = 50257  # the bundled GPT-2 BPE (core/assets/gpt2-tokenizer): a fresh model's embedding rows

# Inclusive bounds. The upper ones are far above anything trainable here; they catch typos
# (n_embd=76800) before a worker tries to allocate the model.
LIMITS: dict[str, tuple[int, int]] = {
    "n_layer": (1, 96),
    "n_embd": (8, 12288),
    "n_head": (1, 128),
    "n_positions": (8, 32768),
}


def validate_model_config(model_config: Mapping[str, int]) -> dict[str, int]:
    """Check a fresh-model architecture and return it complete, with defaults for missing keys."""
    unknown = sorted(set(model_config) - set(LIMITS))
    if unknown:
        raise ValueError(f"model_config: unknown key {unknown[0]!r}; allowed keys are {', '.join(LIMITS)}")
    resolved = dict(DEFAULT_MODEL_CONFIG)
    for key, value in model_config.items():
        # bool is an int subclass, and 4.0 from a JSON body is an easy mistake: accept neither.
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"model_config.{key} must be an integer, got {value!r}")
        low, high = LIMITS[key]
        if not low <= value <= high:
            raise ValueError(f"model_config.{key} must be between {low} and {high}, got {value}")
        resolved[key] = value
    if resolved["n_embd"] % resolved["n_head"]:
        raise ValueError(f"model_config.n_embd ({resolved['n_embd']}) must be divisible by "
                         f"n_head ({resolved['n_head']})")
    return resolved


def resolve_block_size(block_size: int | None, context_length: int) -> int:
    """Tokens per training sequence: the request, else min(context, DEFAULT_BLOCK_SIZE); never above context."""
    if block_size is None:
        return min(context_length, DEFAULT_BLOCK_SIZE)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if block_size > context_length:
        raise ValueError(f"block_size ({block_size}) is larger than the model's context length "
                         f"(n_positions = {context_length})")
    return block_size
