"""GenerationEngine in bf16 on the CPU (what `auto` picks where bf16 matmuls are fast): HF bf16's output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GPT2LMHeadModel

from core.protocol import SamplingParams
from tests.tiny_lm import build_tiny_gpt2
from worker.engines.generation.engine import GenerationEngine

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog and",
           "To be, or not to be: that is the question. Whether 'tis nobler in the mind to suffer", "A"]
WAIT = 60


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2-bf16"), seed=0)


@pytest.fixture(scope="module")
def hf_bf16(model_dir: Path) -> GPT2LMHeadModel:
    return GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    with GenerationEngine(model_dir, device="cpu", precision="bf16", max_batch_size=8) as eng:
        yield eng


def test_bf16_engine_holds_bf16_weights_packed_once(engine, hf_bf16) -> None:
    runner = engine._runner
    assert engine.plan.precision == "bf16" and runner.dtype == torch.bfloat16
    if runner.packed is None:
        pytest.skip("oneDNN packed weights are not available in this torch build")
    assert {t.dtype for layer in runner.packed for t in layer} == {torch.bfloat16}
    # The packed projections and LM head are half the fp32 bytes; no fp32 copy of them is kept.
    projections = sum(p.numel() for name, p in hf_bf16.named_parameters() if name.endswith(".weight") and
                      any(part in name for part in ("c_attn", "c_proj", "c_fc")))
    head = hf_bf16.lm_head.weight.numel()
    assert sum(t.numel() * t.element_size() for layer in runner.packed for t in layer) == 2 * (projections + head)
    assert not [n for n in runner.tensors if n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))]


def test_bf16_greedy_equals_hf_generate_in_bf16_for_a_batch(engine, hf_bf16) -> None:
    futures = [engine.submit(p, SamplingParams(max_new_tokens=20, temperature=0)) for p in PROMPTS]
    for prompt, future in zip(PROMPTS, futures, strict=True):
        ids = engine.encode(prompt)
        with torch.inference_mode():
            out = hf_bf16.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   do_sample=False, max_new_tokens=20, pad_token_id=50256)
        assert future.result(WAIT).choices[0].token_ids == out[0, len(ids):].tolist()


def test_bf16_logits_are_close_to_hf_bf16(engine, hf_bf16, model_dir) -> None:
    # Not bit-equal: the engine fuses GELU into the matmul (one rounding to bf16, HF's tanh GELU rounds at
    # each op) and casts embedding rows as they are looked up; within bf16's resolution of HF's logits.
    from worker.engines.generation.runners.gpt2 import Gpt2Runner
    from worker.engines.generation.runners.gpt2_weights import load_gpt2

    runner = Gpt2Runner(load_gpt2(model_dir, engine.plan), engine.plan, max_rows=4)
    prompts = [engine.encode(p) for p in PROMPTS[1:3]]
    with torch.inference_mode():
        ours = runner.prefill(prompts, [[0], [1]])
        theirs = torch.stack([hf_bf16(torch.tensor([ids])).logits[0, -1].float() for ids in prompts])
    torch.testing.assert_close(ours, theirs, rtol=0.05, atol=0.05)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_a_mapped_weight_is_cast_chunk_by_chunk_to_the_same_values(model_dir) -> None:
    # Packing casts 16 MiB at a time, dropping the fp32 pages read; chunks of a few rows here.
    from worker.engines.device import resolve_device
    from worker.engines.generation.runners.gpt2_weights import _cast, load_gpt2

    weights = load_gpt2(model_dir, resolve_device("cpu", "bf16"))
    table = weights.tensors["wte.weight"]  # still the fp32 mapping: cast rows as looked up
    assert table.dtype == torch.float32 and weights.dtype == torch.bfloat16
    cast = _cast(table, torch.bfloat16, weights.regions["wte.weight"], chunk_bytes=10_000)
    assert torch.equal(cast, table.to(torch.bfloat16))
