"""Prompt logprobs (SamplingParams.prompt_logprobs) in the built-in engine equal HF's log-softmax of the same tokens,
on each runner (GPT-2's, the llama family's, transformers' own), whole, chunked, beside other rows and past the
prefix cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.tiny_llama import build_tiny_decoder
from tests.tiny_lm import build_tiny_gpt2
from worker.engines.generation.engine import GenerationEngine, GenerationResult, SamplingParams

WAIT = 60
PROMPT = "To be, or not to be: that is the question. Whether 'tis nobler in the mind to suffer"
TOP = 3
TOLERANCE = 1e-4  # fp32 on both sides


@pytest.fixture(scope="module", params=["gpt2", "llama", "gemma2"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    """A tiny random model's folder and its fp32 HF model (gemma2 is served by the general runner)."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt2":
        build_tiny_gpt2(folder, seed=0)
        return folder, AutoModelForCausalLM.from_pretrained(folder).eval()
    build_tiny_decoder(request.param, folder)
    # Eager attention: HF's SDPA path leaves out Gemma 2's attention soft-capping, which the engine computes.
    return folder, AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def reference(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """HF's log-softmax at every position, fp32 [len(ids), V]."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def assert_scored(result: GenerationResult, ids: list[int], expected: torch.Tensor, table: list[bytes],
                  top: int = TOP) -> None:
    scored = result.prompt_logprobs
    assert scored is not None and bytes(scored.first.bytes) == table[ids[0]]
    assert len(scored.scored) == len(ids) - 1
    for position, (entry, token) in enumerate(zip(scored.scored, ids[1:], strict=True)):
        assert bytes(entry.bytes) == table[token]
        assert entry.logprob == pytest.approx(expected[position, token].item(), abs=TOLERANCE)
        values, top_ids = expected[position].topk(top)
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [table[i] for i in top_ids.tolist()]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=TOLERANCE)


@pytest.mark.parametrize("chunk", [0, 7])
def test_prompt_logprobs_equal_hf_log_softmax_whole_chunked_and_beside_other_rows(served, chunk) -> None:
    folder, model = served
    with GenerationEngine(folder, device="cpu", precision="fp32", max_batch_size=8,
                          prefill_chunk_tokens=chunk) as engine:
        ids = engine.encode(PROMPT)
        table = engine._loop.table
        expected = reference(model, ids)
        alone = engine.generate(ids, SamplingParams(max_new_tokens=2, temperature=0, prompt_logprobs=TOP))
        assert_scored(alone, ids, expected, table)
        other = engine.encode("Hello there")
        with engine._lock:  # admitted together: a plain prompt's rows, a scored one with two choices, a decode row
            futures = [engine.submit(other, SamplingParams(max_new_tokens=6, temperature=0)),
                       engine.submit(ids, SamplingParams(max_new_tokens=3, temperature=0, n=2, prompt_logprobs=0)),
                       engine.submit(other[:1], SamplingParams(max_new_tokens=1, temperature=0,
                                                               prompt_logprobs=TOP))]
        plain, scored, short = (future.result(WAIT) for future in futures)
    assert plain.prompt_logprobs is None
    assert_scored(scored, ids, expected, table, top=0)
    assert short.prompt_logprobs is not None and short.prompt_logprobs.scored == []  # one token: nothing to score
    # The first generated token is the argmax after the last prompt position, as without scoring.
    assert alone.choices[0].token_ids[0] == int(expected[-1].argmax())


def test_a_scored_prompt_is_computed_whole_past_the_prefix_cache(served) -> None:
    folder, model = served
    with GenerationEngine(folder, device="cpu", precision="fp32", prefix_cache_bytes=1 << 20) as engine:
        ids = engine.encode(PROMPT * 2)
        engine.generate(ids, SamplingParams(max_new_tokens=1, temperature=0))  # its blocks are cached now
        cached = engine.generate(ids, SamplingParams(max_new_tokens=1, temperature=0))
        scored = engine.generate(ids, SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=1))
        table = engine._loop.table
    assert cached.cached_tokens > 0 and scored.cached_tokens == 0
    assert_scored(scored, ids, reference(model, ids), table, top=1)
