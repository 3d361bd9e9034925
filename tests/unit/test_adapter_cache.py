"""Resident adapters: the adapter cache evicts the least recently used adapter that nobody uses, and adapter folders
that batched serving cannot cover are refused when read. (Mixed batches of adapters equal PEFT per adapter:
test_engine_lora_serving.py, through the engine.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.adapters import AdapterConfig
from tests.tiny_chat import build_tiny_llama
from worker.engines.generation.lora.adapter_cache import AdapterCache, AdapterCacheFull, LoraWeights, load_lora_weights
from worker.engines.training import adapters


class RecordingSlots:
    """A slot store that records what was written where (the runner's stacks are tested through the engine)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.written: dict[int, str] = {}

    def write(self, slot: int, weights: LoraWeights) -> None:
        self.written[slot] = weights.name


@pytest.fixture(scope="module")
def wide_adapter(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapter-cache")
    base = build_tiny_llama(root / "base", seed=3)
    torch.manual_seed(0)
    model = adapters.apply_adapter(AutoModelForCausalLM.from_pretrained(base),
                                   AdapterConfig(r=4, alpha=8, target_modules="all-linear"), "causal-lm")
    model.save_pretrained(root / "wide")
    return root / "wide"


def test_cache_evicts_the_least_recently_used_idle_adapter(wide_adapter):
    loads: list[str] = []

    def loader(name: str) -> LoraWeights:
        loads.append(name)
        return load_lora_weights(wide_adapter, name)

    slots = RecordingSlots(capacity=2)
    cache = AdapterCache(slots, loader)
    wide, narrow = cache.acquire("wide"), cache.acquire("narrow")
    assert {wide, narrow} == {1, 2} and cache.acquire("wide") == wide and loads == ["wide", "narrow"]
    assert slots.written == {wide: "wide", narrow: "narrow"}
    with pytest.raises(AdapterCacheFull):
        cache.acquire("third")  # both are in use
    cache.release("narrow")
    assert cache.acquire("third") == narrow and cache.resident() == ["wide", "third"]
    assert slots.written[narrow] == "third"
    cache.release("wide")
    cache.release("wide")
    cache.acquire("narrow")  # wide is idle and least recently used: it goes
    assert cache.resident() == ["third", "narrow"] and loads == ["wide", "narrow", "third", "narrow"]
    with pytest.raises(ValueError, match="released more often"):
        cache.release("wide")


def test_weights_read_from_peft_folder_are_scaled_by_alpha_over_r(wide_adapter):
    weights = load_lora_weights(wide_adapter)
    assert weights.name == "wide" and weights.rank == 4
    assert {projection for _, projection in weights.layers} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"}
    a, b = weights.layers[(0, "q_proj")]
    assert a.shape[0] == 4 and b.shape[1] == 4 and a.dtype == b.dtype == torch.float32


def test_unservable_adapters_are_refused(wide_adapter, tmp_path):
    config = (wide_adapter / "adapter_config.json").read_text()
    (tmp_path / "adapter_config.json").write_text(config.replace('"use_dora": false', '"use_dora": true'))
    (tmp_path / "adapter_model.safetensors").write_bytes((wide_adapter / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="DoRA"):
        load_lora_weights(tmp_path)
