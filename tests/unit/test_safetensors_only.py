"""Workers never unpickle weights: a checkpoint with only a .bin file is refused, whatever resolved it."""

from __future__ import annotations

import pytest
from transformers import GPT2LMHeadModel

from tests.tiny_lm import build_tiny_gpt2
from worker.engines.device import resolve_device
from worker.engines.serving.runners.gpt2 import load_causal_lm
from worker.engines.serving.runners.gpt2_weights import load_gpt2


def test_a_bin_only_checkpoint_is_not_loaded(tmp_path):
    safe = build_tiny_gpt2(tmp_path / "safe", tokenizer=False)
    assert load_causal_lm(safe, resolve_device("cpu")).config.n_layer == 2
    pickled = tmp_path / "pickled"
    GPT2LMHeadModel.from_pretrained(safe).save_pretrained(pickled, safe_serialization=False)
    assert not list(pickled.glob("*.safetensors")) and list(pickled.glob("*.bin"))
    with pytest.raises(OSError, match="safetensors"):
        load_causal_lm(pickled, resolve_device("cpu"))
    with pytest.raises(OSError, match="safetensors"):  # the serving loader, too
        load_gpt2(pickled, resolve_device("cpu"))
