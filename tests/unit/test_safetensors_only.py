"""Workers never unpickle weights: a checkpoint with only a .bin file is refused, whatever resolved it."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2LMHeadModel

from tests.tiny_lm import build_tiny_gpt2
from worker.engines.device import resolve_device
from worker.engines.generation.runners.gpt2_weights import load_gpt2


def test_a_bin_only_checkpoint_is_not_loaded(tmp_path):
    safe = build_tiny_gpt2(tmp_path / "safe", tokenizer=False)
    assert len(load_gpt2(safe, resolve_device("cpu")).tensors) > 0
    pickled = tmp_path / "pickled"
    model = GPT2LMHeadModel.from_pretrained(safe)
    model.config.save_pretrained(pickled)  # transformers 5 saves safetensors only: the pickle written by hand
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    assert not list(pickled.glob("*.safetensors")) and list(pickled.glob("*.bin"))
    with pytest.raises(OSError, match="safetensors"):
        load_gpt2(pickled, resolve_device("cpu"))
