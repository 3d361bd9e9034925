"""LoRA in admission estimates: the adapter's parameter count matches PEFT's, and only it holds AdamW state."""

from __future__ import annotations

import pytest
from transformers import AutoModelForSequenceClassification, LlamaForCausalLM

from core.adapters import AdapterConfig
from core.estimate import adapter_parameter_count, architecture, training_memory
from tests.tiny_chat import tiny_llama_config
from tests.tiny_models import build_tiny_bert
from worker.engines.training.adapters import apply_adapter


def _trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"], ["down_proj", "k_proj", "o_proj"]])
def test_adapter_parameters_of_a_llama_match_peft(targets):
    config = tiny_llama_config(300)
    adapter = AdapterConfig(r=4, target_modules=targets)
    model = apply_adapter(LlamaForCausalLM(config), adapter, "causal-lm")
    arch = architecture(config.to_dict())
    assert adapter_parameter_count(arch, 4, adapter.target_modules) == _trainable(model)


def test_adapter_parameters_of_a_bert_classifier_count_its_new_head(tmp_path):
    folder = build_tiny_bert(tmp_path / "bert")
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2)
    arch = architecture(model.config.to_dict())
    adapter = AdapterConfig(r=8, target_modules=["query", "value"])
    adapted = apply_adapter(model, adapter, "text-classification")
    assert adapter_parameter_count(arch, 8, adapter.target_modules, "classifier", 2) == _trainable(adapted)


def test_lora_needs_adamw_state_for_the_adapter_only():
    arch = architecture(tiny_llama_config(300).to_dict())
    full = training_memory(arch, head="causal-lm", batch_size=2, seq_len=64, precision="fp32")
    trainable = adapter_parameter_count(arch, 4, "all-linear")
    lora = training_memory(arch, head="causal-lm", batch_size=2, seq_len=64, precision="fp32", trainable=trainable)
    assert lora.states_bytes == full.parameters * 4 + trainable * 16
    assert lora.activations_bytes == full.activations_bytes and lora.states_bytes < full.states_bytes / 2
