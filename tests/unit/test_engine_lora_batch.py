"""Many adapters in one batch: gathered per-row LoRA matmuls on a tiny Llama give, row by row, what PEFT gives
with each adapter on its own (and the base for rows without one), prefill and greedy decoding alike; the
adapter cache evicts the least recently used adapter that nobody uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from core.adapters import AdapterConfig
from tests.tiny_chat import build_tiny_llama
from worker.engines.serving.lora.adapter_slots import (
    AdapterCache,
    AdapterCacheFull,
    LoraSlots,
    attach,
    load_lora_weights,
    lora_delta,
    plan_rows,
    projection_shapes,
)
from worker.engines.training import adapters

ADAPTERS = {"wide": AdapterConfig(r=4, alpha=8, target_modules="all-linear"),
            "narrow": AdapterConfig(r=2, alpha=6, target_modules=["q_proj", "v_proj", "down_proj"])}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora-batch")
    base = build_tiny_llama(root / "base", seed=3)
    folders = {}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        model = adapters.apply_adapter(AutoModelForCausalLM.from_pretrained(base), config, "causal-lm")
        with torch.no_grad():  # B starts at zero; give each adapter an effect of its own
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.normal_(0, 0.3)
        model.save_pretrained(root / name)
        folders[name] = root / name
    return base, folders


def _peft(base: Path, folder: Path):
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(folder)).eval()


def _batched(base: Path, folders: dict[str, Path], capacity: int = 2):
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    slots = LoraSlots(projection_shapes(model), capacity=capacity, max_rank=4)
    assert attach(model, slots) == 2 * 7
    cache = AdapterCache(slots, lambda name: load_lora_weights(folders[name]))
    return model, slots, cache


def test_one_batch_mixing_two_adapters_and_the_base_equals_peft_per_adapter(models):
    base, folders = models
    model, slots, cache = _batched(base, folders)
    row_slots = torch.tensor([cache.acquire("wide"), cache.acquire("narrow"), 0, cache.acquire("wide")])
    ids = torch.randint(5, 300, (4, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), slots.rows(row_slots):
        logits = model(ids).logits
    with torch.no_grad():
        expected = [_peft(base, folders["wide"])(ids[[0, 3]]).logits, _peft(base, folders["narrow"])(ids[[1]]).logits,
                    AutoModelForCausalLM.from_pretrained(base).eval()(ids[[2]]).logits]
    torch.testing.assert_close(logits[[0, 3]], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[[1]], expected[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[[2]], expected[2], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits[0], logits[1], atol=1e-3)  # the adapters do differ


def test_greedy_decoding_with_a_kv_cache_matches_peft(models):
    base, folders = models
    model, slots, cache = _batched(base, folders)
    prompts = torch.randint(5, 300, (3, 6), generator=torch.Generator().manual_seed(1))
    row_slots = torch.tensor([cache.acquire("narrow"), 0, cache.acquire("wide")])
    with torch.no_grad(), slots.rows(row_slots):
        out = model.generate(prompts, max_new_tokens=8, do_sample=False, pad_token_id=1)
    references = [_peft(base, folders["narrow"]), AutoModelForCausalLM.from_pretrained(base).eval(),
                  _peft(base, folders["wide"])]
    lengths = []
    for row, reference in enumerate(references):
        with torch.no_grad():
            alone = reference.generate(prompts[row:row + 1], max_new_tokens=8, do_sample=False, pad_token_id=1)
        got, want = out[row].tolist(), alone[0].tolist()
        # A row that ended (eos) earlier than the others is padded in the batch.
        assert got[:len(want)] == want and set(got[len(want):]) <= {1}
        lengths.append(len(want))
    assert max(lengths) == 6 + 8  # at least one row decoded all its tokens


def test_lora_delta_is_the_per_row_product():
    generator = torch.Generator().manual_seed(2)
    a, b = torch.randn(4, 2, 5, generator=generator), torch.randn(4, 2, 3, generator=generator)  # B^T per slot
    a[0], b[0] = 0, 0  # the base slot
    x, slots = torch.randn(5, 2, 5, generator=generator), torch.tensor([3, 0, 1, 3, 0])
    expected = torch.stack([x[i] @ a[s].T @ b[s] for i, s in enumerate(slots.tolist())])
    plan = plan_rows(slots, max_rank=2)
    assert plan is not None and plan.used.tolist() == [1, 3] and plan.mask.shape == (5, 1, 4)
    torch.testing.assert_close(lora_delta(x, a, b, plan), expected)
    torch.testing.assert_close(lora_delta(x[:, 0], a, b, plan), expected[:, 0])
    assert plan_rows(torch.tensor([0, 0]), max_rank=2) is None  # base rows only: nothing to compute


def test_cache_evicts_the_least_recently_used_idle_adapter(models):
    base, folders = models
    loads: list[str] = []
    folders = dict(folders, third=folders["wide"])

    def loader(name):
        loads.append(name)
        return load_lora_weights(folders[name], name)

    model = AutoModelForCausalLM.from_pretrained(base)
    cache = AdapterCache(LoraSlots(projection_shapes(model), capacity=2, max_rank=4), loader)
    wide, narrow = cache.acquire("wide"), cache.acquire("narrow")
    assert {wide, narrow} == {1, 2} and cache.acquire("wide") == wide and loads == ["wide", "narrow"]
    with pytest.raises(AdapterCacheFull):
        cache.acquire("third")  # both are in use
    cache.release("narrow")
    assert cache.acquire("third") == narrow and cache.resident() == ["wide", "third"]
    cache.release("wide")
    cache.release("wide")
    cache.acquire("narrow")  # wide is idle and least recently used: it goes
    assert cache.resident() == ["third", "narrow"] and loads == ["wide", "narrow", "third", "narrow"]
    with pytest.raises(ValueError, match="released more often"):
        cache.release("wide")


def test_unservable_adapters_are_refused(models, tmp_path):
    base, folders = models
    model = AutoModelForCausalLM.from_pretrained(base)
    slots = LoraSlots(projection_shapes(model), capacity=1, max_rank=2)
    with pytest.raises(ValueError, match="rank 4"):
        slots.write(1, load_lora_weights(folders["wide"]))
    config = (folders["wide"] / "adapter_config.json").read_text()
    (tmp_path / "adapter_config.json").write_text(config.replace('"use_dora": false', '"use_dora": true'))
    (tmp_path / "adapter_model.safetensors").write_bytes((folders["wide"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="DoRA"):
        load_lora_weights(tmp_path)
