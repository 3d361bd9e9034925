"""QLoRA (adapter.quantize_base "nf4") on a tiny Llama: the 4-bit base holds about an eighth of the fp32 bytes of its
linear layers, as the estimate counts them; its loss is the full-precision base's within NF4's rounding; a chat
fine-tune over it learns like plain LoRA's; what it saves is an ordinary adapter for the full-precision base, and
the serving engine serves it there as PEFT does; merged/ is that base with the adapter folded in (not a dequantized
copy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from core.adapters import AdapterConfig
from core.estimate import NF4_BYTES, architecture, quantized_parameter_count, training_memory
from tests.tiny_adapters import hf_greedy, peft_model
from tests.tiny_chat import build_tiny_llama
from tests.unit.test_engine_chat_training import (
    _chats,
    _config,
    one_thread,  # noqa: F401 - torch on one thread
)
from worker.engines.device import resolve_device
from worker.engines.models.manifest import MERGED_DIR, read_manifest
from worker.engines.training import quantized
from worker.engines.training.chat import assistant_loss, train_chat
from worker.engines.training.chat_render import collate, render_chat

LORA = AdapterConfig(r=4, alpha=8, dropout=0.0, target_modules="all-linear")
QLORA = LORA.model_copy(update={"quantize_base": "nf4"})
# NF4 rounds each weight to one of 16 levels scaled by its block's absmax: a relative RMS error of about 10% per
# weight, unbiased, so a layer's output moves by about 10% / sqrt(fan-in) of its size. On this 32-wide, 2-layer
# random model (fan-in 32-64) that moves the loss by 3% (measured: 6.85 -> 7.04; SmolLM2-135M: 5%, on an easy loss
# of 0.28). 5% is that rounding with room to spare, far below what an unquantized-vs-random base would differ by.
FIRST_LOSS_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("base") / "tiny-llama", seed=1)


@pytest.fixture(scope="module")
def batch(base) -> dict[str, torch.Tensor]:
    tokenizer = AutoTokenizer.from_pretrained(base)
    return collate([render_chat(tokenizer, chat["messages"], max_length=128) for chat in _chats()],
                   tokenizer.pad_token_id)


def _nf4(base: Path) -> torch.nn.Module:
    plan = resolve_device("cpu", "fp32", training=True)
    return quantized.load_quantized(str(base), AutoConfig.from_pretrained(base), plan)


def test_the_4bit_base_holds_its_linear_layers_at_nf4_size(base):
    full, four_bit = AutoModelForCausalLM.from_pretrained(base), _nf4(base)
    assert quantized.is_quantized(four_bit) and not quantized.is_quantized(full)
    assert type(four_bit.get_output_embeddings()) is torch.nn.Linear  # the output head stays full (chunked loss)
    arch = architecture(full.config.to_dict())
    assert arch is not None
    linears = quantized_parameter_count(arch)
    assert linears == sum(m.weight.numel() for name, m in full.named_modules()
                          if isinstance(m, torch.nn.Linear) and name != "lm_head")
    layers = sum(type(m).__name__ == "Linear4bit" for m in four_bit.modules())
    saved = quantized.weight_bytes(full) - quantized.weight_bytes(four_bit)
    # 4 bytes a weight became NF4_BYTES, plus each layer's code tables (NF4's 16 values and the 8-bit absmax's 256,
    # fp32): 1 KB a layer, a quarter of this toy model's 4-bit bytes, 0.4% of a SmolLM2-135M layer's (the estimate
    # leaves them out)
    tables = layers * (16 + 256) * 4
    assert saved == pytest.approx(linears * (4 - NF4_BYTES) - tables, rel=0.01)
    assert 1 / 8 <= NF4_BYTES / 4 <= 1 / 4


def test_the_estimate_counts_the_base_at_nf4_size(base):
    arch = architecture(AutoConfig.from_pretrained(base).to_dict())
    assert arch is not None
    sizes = {"head": "causal-lm", "batch_size": 2, "seq_len": 64, "precision": "fp32", "trainable": 1000}
    plain, four_bit = training_memory(arch, **sizes), training_memory(arch, quantized_base=True, **sizes)
    linears = quantized_parameter_count(arch)
    dequantized = linears // arch.layers * 4  # one layer's matrices at a time in the compute dtype
    assert plain.states_bytes - four_bit.states_bytes == linears * 4 - int(linears * NF4_BYTES) - dequantized
    assert four_bit.activations_bytes == plain.activations_bytes


def test_the_first_loss_over_the_4bit_base_is_the_full_bases_within_nf4_rounding(base, batch):
    with torch.no_grad():
        full = assistant_loss(AutoModelForCausalLM.from_pretrained(base), None, **batch).item()
        four_bit = assistant_loss(_nf4(base), None, **batch).item()
    assert four_bit != full  # it is quantized
    assert abs(four_bit - full) <= FIRST_LOSS_TOLERANCE * full


def test_qlora_trains_like_lora_and_saves_an_adapter_for_the_full_precision_base(tmp_path, base, batch):
    with torch.no_grad():
        before = assistant_loss(AutoModelForCausalLM.from_pretrained(base), None, **batch).item()
    runs = {}
    for name, adapter in (("lora", LORA), ("qlora", QLORA)):
        (tmp_path / name).mkdir()
        runs[name] = train_chat(_config(tmp_path / name, base, _chats(), adapter=adapter, gradient_checkpointing=True))
    lora, qlora = runs["lora"], runs["qlora"]
    assert qlora.status == "completed"
    assert qlora.metrics["eval_loss"] < before / 2
    # the same 24 steps from the same adapter init: the 4-bit base ends where the full one does, within its rounding
    assert qlora.metrics["eval_loss"] == pytest.approx(lora.metrics["eval_loss"], abs=0.25)
    memory = qlora.manifest["hyperparameters"]["memory"]
    assert memory["gradient_checkpointing"] and memory["loss"] == "chunked" and memory["packing"]
    assert memory["quantized_base"]["format"] == "nf4"
    assert memory["quantized_base"]["backend"].startswith("bitsandbytes ")
    assert lora.manifest["hyperparameters"]["memory"]["quantized_base"] is None
    # An ordinary PEFT adapter: it loads onto the full-precision base and keeps what it learned there.
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(qlora.model_dir)).eval()
    assert not quantized.is_quantized(adapted)
    with torch.no_grad():
        assert assistant_loss(adapted, None, **batch).item() < before / 2


def test_a_qlora_adapter_serves_on_the_full_precision_base_as_peft_does_and_merges_into_its_weights(tmp_path, base):
    from worker.engines.generation.engine import GenerationEngine, SamplingParams

    result = train_chat(_config(tmp_path, base, _chats(), max_steps=4,
                                adapter=QLORA.model_copy(update={"merge": True})))
    folder = result.model_dir
    assert folder is not None
    want = peft_model(base, folder)
    prompts = [[0, 5, 9, 17, 33, 60], [0, 44, 12]]
    params = SamplingParams(max_new_tokens=8, temperature=0)
    with GenerationEngine(base, device="cpu", precision="fp32", max_batch_size=4, max_loras=1,
                          adapter_folder=lambda name: folder) as engine:
        results = [engine.submit(prompt, params, adapter="qlora").result(60) for prompt in prompts]
    for prompt, served in zip(prompts, results, strict=True):
        assert served.choices[0].token_ids == hf_greedy(want, prompt, 8)
    assert any(hf_greedy(want, p, 8) != hf_greedy(peft_model(base, None), p, 8) for p in prompts)  # it learned

    # The merged copy folds the adapter into the base's original weights, not into weights rounded to 4 bits.
    assert read_manifest(folder)["merged"] == MERGED_DIR
    merged = AutoModelForCausalLM.from_pretrained(folder / MERGED_DIR).eval()
    assert not quantized.is_quantized(merged)
    expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(folder)).merge_and_unload()
    merged_weights, expected_weights = merged.state_dict(), expected.eval().state_dict()
    assert merged_weights.keys() == expected_weights.keys()
    for name, weight in expected_weights.items():
        torch.testing.assert_close(merged_weights[name], weight, rtol=0, atol=0, msg=name)
    full = AutoModelForCausalLM.from_pretrained(base).state_dict()
    torch.testing.assert_close(merged_weights["model.embed_tokens.weight"], full["model.embed_tokens.weight"])
    assert not torch.equal(merged_weights["model.layers.0.self_attn.q_proj.weight"],
                           full["model.layers.0.self_attn.q_proj.weight"])  # the adapter is in it


def test_a_classifier_adapter_refuses_a_4bit_base(tmp_path):
    from worker.engines.training.classifier import ClassifierRecipe, TrainConfig

    config = TrainConfig(train_file=tmp_path / "train.csv", output_dir=tmp_path / "out", base_model="minilm-l6",
                         text_column="text", label_column="label", eval_file=None, checkpoint_dir=tmp_path / "ckpt",
                         adapter=QLORA)
    with pytest.raises(ValueError, match="adapter.quantize_base"):
        ClassifierRecipe(config)
