"""core/estimate.py: exact parameter counts, peaks near measured ones, and the jobs issue 7 named refused."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

from core.estimate import architecture, format_bytes, load_model_config, parameter_count, training_memory
from tests.tiny_models import build_tiny_bert

ROOT = Path(__file__).resolve().parents[2]
TB = 10**12

# One CPU training step measured in a fresh process: the resident-set peak of two optimizer steps (the
# second holds AdamW's moments) above the resident set before the model existed.
PROBE = """
import json, re, sys
import torch
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel
from worker.engines.device import resolve_device
from worker.engines.training.loop import build_adamw, train_step
from worker.engines.training.causal_lm import next_token_loss

torch.set_num_threads(1)
kind, config, batch, seq = json.loads(sys.argv[1])
def rss(field):
    return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
torch.manual_seed(0)
inputs = torch.randint(0, config["vocab_size"], (batch, seq + 1))
labels = torch.randint(0, 2, (batch,))
open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current resident set
before = rss("VmRSS")
plan = resolve_device("cpu", "fp32")
if kind == "causal-lm":
    model = GPT2LMHeadModel(GPT2Config(**config))
else:
    model = BertForSequenceClassification(BertConfig(**config))
model.train()
optimizer = build_adamw(model, learning_rate=1e-3, weight_decay=0.1, betas=(0.9, 0.95), plan=plan)

class Task:
    def loss(self, forward, rows):
        if kind == "causal-lm":
            return next_token_loss(forward, inputs[rows, :-1], inputs[rows, 1:])
        return forward(input_ids=inputs[rows, :-1], labels=labels[rows]).loss

for _ in range(2):
    train_step(model, optimizer, plan.grad_scaler(), plan, Task(), [list(range(batch))], 1e-3)
print(json.dumps(rss("VmHWM") - before))
"""

GPT2_LOGITS = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 128, "vocab_size": 50257, "model_type": "gpt2"}
GPT2_LAYERS = {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 128, "vocab_size": 1000, "model_type": "gpt2"}
BERT = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024,
        "vocab_size": 1000, "max_position_embeddings": 128, "model_type": "bert"}


def test_parameter_counts_are_exact_for_bert_and_gpt2(tmp_path):
    bert = BertConfig(**{k: v for k, v in BERT.items() if k != "model_type"}, num_labels=3)
    assert parameter_count(architecture(bert.to_dict()), "classifier", 3) == \
        BertForSequenceClassification(bert).num_parameters()
    gpt2 = GPT2Config(**{k: v for k, v in GPT2_LAYERS.items() if k != "model_type"})
    assert parameter_count(architecture(gpt2.to_dict()), "causal-lm") == GPT2LMHeadModel(gpt2).num_parameters()
    folder = build_tiny_bert(tmp_path / "bert")
    assert load_model_config(str(folder))["hidden_size"] == 32
    assert load_model_config(str(tmp_path / "missing")) is None
    assert load_model_config("nobody/not-in-the-cache") is None


def test_architecture_reads_the_common_key_names():
    llama = architecture({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
                          "max_position_embeddings": 4096, "tie_word_embeddings": False})
    assert llama is not None and llama.gated_mlp and llama.positions == 0 and llama.kv_hidden == 32
    distil = architecture({"n_layers": 6, "dim": 768, "n_heads": 12, "hidden_dim": 3072, "vocab_size": 30522})
    assert distil is not None and (distil.layers, distil.hidden, distil.intermediate) == (6, 768, 3072)
    assert architecture({"hidden_size": 64}) is None
    assert architecture({"n_layer": True, "n_embd": 64, "vocab_size": 10}) is None


@pytest.mark.parametrize(("head", "config", "batch", "seq"), [
    ("causal-lm", GPT2_LOGITS, 8, 128),  # dominated by the logits over GPT-2's vocabulary
    ("causal-lm", GPT2_LAYERS, 16, 128),  # dominated by the layers' activations
    ("classifier", BERT, 16, 128),
])
def test_estimate_is_near_a_measured_cpu_peak(head, config, batch, seq):
    hf_config = {k: v for k, v in config.items() if k != "model_type"}
    probe = subprocess.run([sys.executable, "-c", PROBE, json.dumps([head, hf_config, batch, seq])], cwd=ROOT,
                           capture_output=True, text=True, check=True)
    measured = json.loads(probe.stdout)
    estimate = training_memory(architecture(config), head=head, batch_size=batch, seq_len=seq, precision="fp32",
                               fused_attention=False)
    model_bytes = estimate.states_bytes + estimate.activations_bytes  # the runtime was there before
    assert 0.5 < measured / model_bytes < 2.0, (format_bytes(measured), estimate.describe())


def test_the_jobs_from_the_issue_need_terabytes():
    wide = architecture({"n_layer": 96, "n_embd": 12288, "n_head": 96, "n_positions": 256, "vocab_size": 50257})
    assert wide is not None
    huge = training_memory(wide, head="causal-lm", batch_size=8, seq_len=256, precision="bf16")
    assert huge.parameters > 170e9 and huge.fixed_bytes > 2 * TB  # 16 bytes per parameter before any batch
    long = architecture({"n_layer": 6, "n_embd": 384, "n_head": 6, "n_positions": 32768, "vocab_size": 50257})
    assert long is not None
    big_batch = training_memory(long, head="causal-lm", batch_size=1024, seq_len=32768, precision="bf16")
    assert big_batch.fixed_bytes < 10**10 and big_batch.activations_bytes > 10 * TB
    assert "TB" in big_batch.describe() and "33554432 tokens per micro-batch" in big_batch.describe()


def test_estimate_and_capacity_stay_import_light():
    code = "import sys, core.estimate, core.capacity; assert not {'torch', 'transformers'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("name", ["gemma3", "gemma2", "phi3", "olmo2", "granite", "mixtral", "qwen3_moe", "gpt_oss"])
def test_todays_architectures_count_their_parameters_from_config_json(name, tmp_path):
    # head_dim apart from hidden / heads (Gemma, Qwen3-MoE, gpt-oss) and every expert of a mixture (all train).
    from tests.tiny_llama import build_tiny_decoder

    model, _ = build_tiny_decoder(name, tmp_path / name)
    arch = architecture(json.loads((tmp_path / name / "config.json").read_text()))
    assert arch is not None
    real = sum(p.numel() for p in model.parameters())
    assert abs(parameter_count(arch, "causal-lm") - real) / real < 0.01
    if name in ("mixtral", "qwen3_moe", "gpt_oss"):  # 4 experts, 2 a token: activations count the 2
        assert (arch.experts, arch.active_experts) == (4, 2)
        dense = dataclasses.replace(arch, experts=1, active_experts=1)
        one = dataclasses.replace(arch, active_experts=1)
        kwargs = {"head": "causal-lm", "batch_size": 2, "seq_len": 64, "precision": "fp32"}
        assert training_memory(one, **kwargs).activations_bytes < training_memory(arch, **kwargs).activations_bytes
        experts_and_router = arch.layers * (3 * 3 * arch.hidden * arch.intermediate + 4 * arch.hidden)
        assert parameter_count(arch, "causal-lm") - parameter_count(dense, "causal-lm") == experts_and_router


def test_sharded_states_are_a_share_plus_one_gathered_layer():
    gpt2 = architecture({"n_layer": 24, "n_embd": 1024, "n_head": 16, "n_positions": 64, "vocab_size": 50257})
    assert gpt2 is not None
    whole = training_memory(gpt2, head="causal-lm", batch_size=2, seq_len=64, precision="bf16")
    halves = training_memory(gpt2, head="causal-lm", batch_size=2, seq_len=64, precision="bf16", shards=2)
    layer = whole.parameters // 24 * 2  # bf16 gathered parameters of one layer
    assert halves.states_bytes == whole.states_bytes // 2 + layer
    assert halves.activations_bytes == whole.activations_bytes
