"""LoRA through PEFT in the one training loop: a causal-LM job with an adapter on a tiny Llama trains only the
adapter, checkpoints and resumes it exactly, and saves PEFT's folder that PeftModel.from_pretrained loads; the
merged export gives the same logits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import safetensors.torch
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, BertConfig

from core.adapters import AdapterConfig
from tests.tiny_chat import CORPUS, build_tiny_llama
from worker.engines.models import adapters as model_adapters
from worker.engines.training import adapters, artifacts
from worker.engines.training.causal_lm import LMTrainConfig, train_lm

LORA = AdapterConfig(r=4, alpha=8, dropout=0.1, target_modules="all-linear")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("base") / "tiny-llama")


def _config(root: Path, base: Path, **overrides) -> LMTrainConfig:
    corpus = root / "corpus.txt"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    corpus.write_text(CORPUS * 2)
    values = dict(train_file=corpus, eval_file=None, output_dir=root / "out", checkpoint_dir=root / "ckpt",
                  base_model=str(base), block_size=16, batch_size=2, gradient_accumulation_steps=2, max_steps=6,
                  learning_rate=2e-2, warmup_ratio=0.2, seed=5, device="cpu", precision="fp32", adapter=LORA,
                  base_model_name="tiny-llama")
    values.update(overrides)
    return LMTrainConfig(**values)


def _adapter(folder: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(folder / "adapter_model.safetensors"))


class StopAt:
    """Callbacks that cancel after `steps` optimizer steps."""

    def __init__(self, steps: int) -> None:
        self.steps, self.seen = steps, 0

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def on_log(self, step, epoch, metrics):
        self.seen = step

    def stop_reason(self):
        return None

    def should_stop(self):
        return self.seen >= self.steps


def test_lora_job_saves_a_peft_folder_that_loads_and_merges(tmp_path, base):
    result = train_lm(_config(tmp_path, base))
    out = result.model_dir
    assert result.status == "completed" and math.isfinite(result.metrics["eval_loss"])
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "manifest.json"} <= names
    assert "model.safetensors" not in names  # the base is not copied
    manifest = json.loads((out / "manifest.json").read_text())
    summary = manifest["adapter"]
    assert summary["r"] == 4 and set(summary["target_modules_resolved"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # lm_head is not adapted
    assert summary["trainable_parameters"] < summary["total_parameters"] // 5
    assert model_adapters.adapter_bytes(out) < (base / "model.safetensors").stat().st_size // 5

    ids = torch.tensor([[0, 10, 20, 30, 40, 50, 60]])
    plain = AutoModelForCausalLM.from_pretrained(base).eval()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(out)).eval()
    with torch.no_grad():
        base_logits, adapted = plain(ids).logits, loaded(ids).logits
    assert not torch.allclose(base_logits, adapted, atol=1e-3)  # the adapter learned something (B moved from 0)
    assert torch.equal(model_adapters.load_adapted(out)(ids).logits.detach(), adapted)
    merged_dir = model_adapters.export_merged(out, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, atol=1e-4, rtol=1e-4)
    assert json.loads((merged_dir / "manifest.json").read_text())["merged_from_adapter"]["r"] == 4


def test_cancel_and_resume_gives_the_same_adapter(tmp_path, base):
    whole = train_lm(_config(tmp_path / "whole", base))
    parted = _config(tmp_path / "parted", base, checkpoint_steps=2)
    stopped = train_lm(parted, StopAt(4))
    assert stopped.status == "cancelled"
    checkpoint = parted.checkpoint_dir / "checkpoint-4"
    assert (checkpoint / "adapter.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    saved = safetensors.torch.load_file(str(checkpoint / "adapter.safetensors"))
    assert saved and all("lora_" in name for name in saved)  # only the adapter, no frozen base tensor
    resumed = train_lm(parted)
    assert resumed.metrics["eval_loss"] == whole.metrics["eval_loss"]
    expected, got = _adapter(whole.model_dir), _adapter(resumed.model_dir)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    other = _config(tmp_path / "parted", base, adapter=AdapterConfig(r=2, target_modules=["q_proj"]),
                    max_steps=8, checkpoint_steps=2)
    with pytest.raises(ValueError, match="adapter"):
        train_lm(other)  # the checkpoint's adapter is not this run's


def test_classification_adapter_trains_the_head_too(tmp_path):
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, num_labels=3)
    torch.manual_seed(0)
    model = adapters.apply_adapter(AutoModelForSequenceClassification.from_config(config),
                                   AdapterConfig(r=2, target_modules=["query", "value"]), "text-classification")
    trainable = artifacts.trainable_tensors(model)
    assert any("classifier" in name for name in trainable) and any("lora_A" in name for name in trainable)
    assert not any("word_embeddings" in name for name in trainable)
    with pytest.raises(ValueError, match="target_modules"):
        adapters.apply_adapter(AutoModelForSequenceClassification.from_config(config),
                               AdapterConfig(target_modules=["nope_proj"]), "text-classification")


def test_adapter_settings_are_validated():
    assert AdapterConfig().model_dump() == {"method": "lora", "r": 8, "alpha": 16.0, "dropout": 0.05,
                                            "target_modules": "all-linear", "merge": False, "quantize_base": None}
    assert AdapterConfig(target_modules=["v_proj", "q_proj", "q_proj"]).target_modules == ["q_proj", "v_proj"]
    for bad in ({"r": 0}, {"dropout": 1.0}, {"target_modules": []}, {"target_modules": ["a b"]},
                {"target_modules": "all"}, {"rank": 4}, {"method": "ia3"}):
        with pytest.raises(ValueError):
            AdapterConfig(**bad)
    with pytest.raises(ValueError, match="base_model"):
        train_lm(LMTrainConfig(train_file=Path("x.txt"), eval_file=None, output_dir=Path("o"),
                               checkpoint_dir=Path("c"), adapter=LORA))
