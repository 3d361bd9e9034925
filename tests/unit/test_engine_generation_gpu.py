"""GenerationEngine on CUDA: fp32 greedy equals HF, and the half-precision plans run the model in that dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GPT2LMHeadModel

from tests.tiny_lm import build_tiny_gpt2
from worker.engines.generation.engine import GenerationEngine, SamplingParams

pytestmark = pytest.mark.gpu
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog and", "A"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2-gpu"), seed=0)


def test_fp32_greedy_on_cuda_matches_hf(model_dir: Path) -> None:
    hf = GPT2LMHeadModel.from_pretrained(model_dir).to("cuda").eval()
    with GenerationEngine(model_dir, device="cuda", precision="fp32") as engine:
        with engine._lock:  # one batched prefill for all prompts
            futures = [engine.submit(p, SamplingParams(max_new_tokens=16, temperature=0)) for p in PROMPTS]
        for prompt, future in zip(PROMPTS, futures, strict=True):
            ids = torch.tensor([engine.encode(prompt)], device="cuda")
            with torch.inference_mode():
                expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                                       pad_token_id=50256)[0, ids.shape[1]:].tolist()
            assert future.result(60).choices[0].token_ids == expected


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_runs_in_that_dtype(model_dir: Path, precision: str) -> None:
    with GenerationEngine(model_dir, device="cuda", precision=precision) as engine:
        assert engine._runner.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
        params = SamplingParams(max_new_tokens=12, top_p=0.9, seed=3, n=2, repetition_penalty=1.2)
        first, again = engine.generate(PROMPTS[1], params), engine.generate(PROMPTS[1], params)
    assert [len(c.token_ids) for c in first.choices] == [12, 12]
    assert first.choices == again.choices  # seeded: same draws on the device as well
