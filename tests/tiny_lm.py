"""Tiny deterministic GPT-2s for generation tests: random weights from a fixed seed, the real GPT-2 BPE."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

from core.paths import GPT2_TOKENIZER_DIR
from tests.tiny_cache import cached_build

ASSETS_TOKENIZER = GPT2_TOKENIZER_DIR
GPT2_EOS = 50256


def build_tiny_gpt2(
    path: Path, seed: int = 0, n_positions: int = 128, *, eos_token_id: int = GPT2_EOS, tokenizer: bool = True,
) -> Path:
    """Save a 2-layer, 32-wide GPT-2 (50,257-token vocab) under `path`, with the GPT-2 tokenizer unless told not to.

    Built once per process for each set of arguments; later calls copy that folder.
    """
    build = partial(_build_tiny_gpt2, seed=seed, n_positions=n_positions, eos_token_id=eos_token_id,
                    tokenizer=tokenizer)
    return cached_build(("gpt2", seed, n_positions, eos_token_id, tokenizer), build, path)


def _build_tiny_gpt2(path: Path, *, seed: int, n_positions: int, eos_token_id: int, tokenizer: bool) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = GPT2Config(
        vocab_size=50257, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=GPT2_EOS, eos_token_id=eos_token_id,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        GPT2TokenizerFast.from_pretrained(ASSETS_TOKENIZER).save_pretrained(path)
    return path
