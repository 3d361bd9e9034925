"""LoRA adapters in the serving engine: one batch mixing base rows and rows of two adapters (different ranks and
target modules, prompts of different lengths) decodes greedily, row by row, what HF `generate` gives on
`PeftModel.from_pretrained(base, folder)` for that row alone (fp32; GQA, MQA, tied and untied heads, qwen2
biases, qwen3 q/k norms); with one slot, a second adapter waits for the first to go idle instead of failing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.adapters import AdapterConfig
from tests.tiny_adapters import ADAPTERS, hf_greedy, make_adapters, peft_model
from tests.tiny_llama import build_tiny_decoder
from worker.engines.generation.engine import GenerationEngine, SamplingParams

ARCHS = ["llama", "llama3", "qwen2", "qwen3"]  # GQA untied, MQA tied, biases + windows tied, q/k norms untied
WAIT = 60


def references(base: Path, folders: dict[str, Path]) -> dict[str | None, object]:
    return {None: peft_model(base, None), **{name: peft_model(base, folder) for name, folder in folders.items()}}


@pytest.mark.parametrize(("arch", "chunk"), [(arch, 512) for arch in ARCHS] + [(ARCHS[0], 4)])
def test_a_batch_mixing_adapters_and_the_base_equals_peft_row_by_row(arch, chunk, tmp_path):
    base = tmp_path / "base"
    build_tiny_decoder(arch, base)
    folders = make_adapters(base, tmp_path)
    want = references(base, folders)
    gen = torch.Generator().manual_seed(0)
    rows = [(None, 5), ("wide", 9), ("narrow", 3), ("wide", 12), (None, 7), ("narrow", 10)]
    prompts = [torch.randint(3, 300, (length,), generator=gen).tolist() for _, length in rows]
    later = [("narrow", 4), ("wide", 6), (None, 8)]  # arrive while the first rows decode: prefill + decode mixed
    late_prompts = [torch.randint(3, 300, (length,), generator=gen).tolist() for _, length in later]
    params = SamplingParams(max_new_tokens=12, temperature=0)
    # The chunked case caches prefixes too: the same prompt through another adapter must not hit (keys differ).
    prefix = (1 << 20) if chunk < 16 else 0
    if prefix:
        prompts[1] = prompts[1] + prompts[1] + prompts[1][:5]  # 23 tokens: one full block
        later.append(("narrow", 0))
        late_prompts.append(prompts[1])
    with GenerationEngine(base, device="cpu", precision="fp32", max_batch_size=16, max_loras=2,
                              adapter_folder=lambda name: folders[name], prefill_chunk_tokens=chunk,
                              prefix_cache_bytes=prefix) as engine:
        with engine._lock:  # admitted together: one prefill of every row, adapters and base
            futures = [engine.submit(p, params, adapter=a) for (a, _), p in zip(rows, prompts, strict=True)]
        first_tokens = engine.submit(prompts[0], SamplingParams(max_new_tokens=1, temperature=0))
        first_tokens.result(WAIT)
        futures += [engine.submit(p, params, adapter=a) for (a, _), p in zip(later, late_prompts, strict=True)]
        results = [f.result(WAIT) for f in futures]
        stats = engine.stats()
        if prefix:  # the base's own repeat of prompts[0] (a 5-token prompt: no full block) and "narrow" miss
            assert [r.cached_tokens for r in results] == [0] * len(results)
            again = engine.submit(prompts[1], params, adapter="wide").result(WAIT)  # "wide" hits its own block
            assert again.cached_tokens == 16 and again.choices[0].token_ids == results[1].choices[0].token_ids
    assert stats["peak_running_sequences"] >= len(rows) and sorted(stats["adapters"]) == ["narrow", "wide"]
    for (adapter, _), prompt, result in zip(rows + later, prompts + late_prompts, results, strict=True):
        assert result.choices[0].token_ids == hf_greedy(want[adapter], prompt, 12), (arch, adapter, len(prompt))
    outputs = {adapter: result.choices[0].token_ids
               for (adapter, _), result in zip(rows, results[:len(rows)], strict=True)}
    assert len({tuple(v) for v in outputs.values()}) == 3  # base and both adapters do differ


def test_with_one_slot_an_adapter_waits_for_the_other_to_go_idle(tmp_path):
    base = tmp_path / "base"
    build_tiny_decoder("llama", base)
    folders = make_adapters(base, tmp_path)
    want = references(base, folders)
    reads: list[str] = []

    def folder(name: str) -> Path:
        reads.append(name)
        return folders[name]

    params = SamplingParams(max_new_tokens=10, temperature=0)
    prompt = [5, 17, 42, 99]
    with GenerationEngine(base, device="cpu", precision="fp32", max_batch_size=8, max_loras=1,
                              adapter_folder=folder) as engine:
        with engine._lock:
            futures = [engine.submit(prompt, params, adapter=name) for name in ("wide", "narrow", "wide")]
            futures.append(engine.submit(prompt, params))  # the base passes the waiting adapter
        results = [f.result(WAIT) for f in futures]
        # The second wide (resident) and the base pass narrow, which waits for wide to go idle, then evicts it.
        assert engine.stats()["adapters"] == ["narrow"]
    for name, result in zip(["wide", "narrow", "wide", None], results, strict=True):
        assert result.choices[0].token_ids == hf_greedy(want[name], prompt, 10), name
    assert reads == ["wide", "narrow", "wide"]  # each read in submit (none resident yet), none on the decode loop


def test_an_adapter_of_another_base_is_refused(tmp_path):
    base, other = tmp_path / "base", tmp_path / "other"
    build_tiny_decoder("llama", base)
    build_tiny_decoder("qwen3", other)  # head_dim 32: q_proj is 128 x 64, not 64 x 64
    folders = make_adapters(other, tmp_path)
    with GenerationEngine(base, device="cpu", precision="fp32", max_loras=1,
                              adapter_folder=lambda name: folders[name]) as engine:
        with pytest.raises(ValueError, match="another base model"):
            engine.submit([1, 2, 3], SamplingParams(max_new_tokens=2), adapter="wide")
        assert engine.generate([5, 6, 7], SamplingParams(max_new_tokens=2, temperature=0)).choices


def test_a_higher_rank_adapter_grows_the_slots_and_keeps_the_resident_one(tmp_path):
    base = tmp_path / "base"
    build_tiny_decoder("llama", base)
    folders = make_adapters(base, tmp_path, {"wide": ADAPTERS["wide"], "big": AdapterConfig(
        r=16, alpha=16, target_modules=["o_proj", "up_proj"])})
    params = SamplingParams(max_new_tokens=10, temperature=0)
    prompt = [5, 17, 42, 99]
    with GenerationEngine(base, device="cpu", precision="fp32", max_loras=2,
                              adapter_folder=lambda name: folders[name]) as engine:
        assert engine.lora is not None and engine.lora.nbytes == 0  # nothing allocated before an adapter
        wide = engine.submit(prompt, params, adapter="wide").result(WAIT)
        small = engine.lora.nbytes
        big = engine.submit(prompt, params, adapter="big").result(WAIT)
        assert engine.lora.stacks.max_rank == 16 and engine.lora.nbytes == 2 * small
        again = engine.submit(prompt, params, adapter="wide").result(WAIT)  # resident, moved into the wider stacks
        assert engine.stats()["adapters"] == ["big", "wide"]
    for name, result in (("wide", wide), ("big", big), ("wide", again)):
        assert result.choices[0].token_ids == hf_greedy(peft_model(base, folders[name]), prompt, 10), name


@pytest.mark.parametrize("slots", [
    [1, 2, 3, 0, 1, 2, 3, 4, 0, 4],  # decode rows spread evenly over four adapters and the base: grouped
    [1] * 20 + [2, 3, 0, 4],  # one adapter holds most tokens: padding the others to it would cost more, masked
])
def test_grouped_and_masked_updates_give_each_token_its_own_adapter(slots):
    """Tokens spread over several adapters go grouped (one batched matmul per adapter group) where that is less
    work than the masked matmul over every used adapter; both give each token exactly its own adapter's update."""
    from worker.engines.generation.lora.adapter_cache import LoraWeights
    from worker.engines.generation.lora.runner_lora import RunnerLora

    torch.manual_seed(0)
    hidden, kv, inner = 16, 8, 24
    outputs = {"qkv": (hidden, kv, kv), "o": (hidden,), "gate_up": (inner, inner), "down": (hidden,)}
    inputs = {"qkv": hidden, "o": hidden, "gate_up": hidden, "down": inner}
    lora = RunnerLora(hidden, outputs, inputs, 1, capacity=4, max_rank=8, device=torch.device("cpu"),
                      dtype=torch.float32)
    projections = {"q_proj": hidden, "k_proj": kv, "v_proj": kv, "o_proj": hidden, "gate_proj": inner,
                   "up_proj": inner, "down_proj": hidden}
    adapters = {}
    for slot, rank in zip((1, 2, 3, 4), (2, 8, 4, 8), strict=True):
        layers = {(0, name): (torch.randn(rank, inner if name == "down_proj" else hidden), torch.randn(out, rank))
                  for name, out in projections.items()}
        adapters[slot] = layers
        lora.write(slot, LoraWeights(name=f"a{slot}", rank=rank, layers=layers))
    lora.set_rows(slots, [])
    lora.begin(len(slots), 0, 0)
    assert lora.plan is not None and (lora.plan.grouped is not None) == (slots[0] != slots[1])
    x = torch.randn(len(slots), hidden)
    base = torch.zeros(len(slots), hidden + 2 * kv)
    got = lora.add(0, "qkv", x, base)
    lora.plan.grouped = None  # the masked matmul over every used adapter
    masked = lora.add(0, "qkv", x, base)
    for token, slot in enumerate(slots):
        expected = torch.zeros(hidden + 2 * kv)
        if slot:
            expected = torch.cat([adapters[slot][(0, name)][1] @ (adapters[slot][(0, name)][0] @ x[token])
                                  for name in ("q_proj", "k_proj", "v_proj")])
        torch.testing.assert_close(got[token], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(masked[token], expected, rtol=1e-5, atol=1e-5)
