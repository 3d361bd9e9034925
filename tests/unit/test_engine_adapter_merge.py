"""adapter.merge: a LoRA job's artifact also holds merged/, a full model equal to the base with the adapter on top."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from core.adapters import AdapterConfig
from tests.tiny_chat import QUESTIONS, build_tiny_llama
from worker.engines.models.manifest import MERGED_DIR, read_manifest
from worker.engines.training.chat import ChatTrainConfig, train_chat


def test_merge_writes_a_full_model_that_equals_base_plus_adapter(tmp_path: Path):
    base = build_tiny_llama(tmp_path / "base", seed=4)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": "Blue."}]}) + "\n"
                            for q in QUESTIONS))
    config = ChatTrainConfig(train_file=data, eval_file=None, output_dir=tmp_path / "out",
                             checkpoint_dir=tmp_path / "ckpt", base_model=str(base), max_steps=4, batch_size=2,
                             learning_rate=5e-2, weight_decay=0.0, device="cpu", precision="fp32", max_length=64,
                             adapter=AdapterConfig(r=4, alpha=8, dropout=0.0, merge=True))
    result = train_chat(config)
    assert result.status == "completed"
    out = config.output_dir
    assert read_manifest(out)["merged"] == MERGED_DIR
    merged = AutoModelForCausalLM.from_pretrained(out / MERGED_DIR).eval()
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(out)).eval()
    ids = torch.tensor([[0, 5, 9, 17, 33, 60]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(adapted(ids).logits, AutoModelForCausalLM.from_pretrained(base)(ids).logits)
