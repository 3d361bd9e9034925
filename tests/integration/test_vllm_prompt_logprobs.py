"""The vLLM engine's scored prompts against a real vLLM server (its CPU build) on SmolLM2-135M: prompt_logprobs asked
as vLLM's streamed echo come back apart from the choices' own, equal to HF's log-softmax on the same tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.protocol import SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


def test_vllm_scores_a_prompt_as_hf_and_its_choices_apart() -> None:
    from trainserve.real_models import ModelUnavailable, build_smollm2
    from worker.engines.vllm.engine import VllmEngine, VllmOptions
    from worker.engines.vllm.server import find_python

    python = find_python()
    if python is None:
        pytest.skip("vLLM's CPU build is not installed: `make vllm` (make test does)")
    try:
        folder = build_smollm2()
    except ModelUnavailable as exc:
        pytest.skip(str(exc))
    with VllmEngine(folder, VllmOptions(python=python, dtype="float32", threads=2), max_batch_size=4) as engine:
        ids = engine.encode("To be, or not to be: that is the question.")
        scored = engine.generate(ids, SamplingParams(max_new_tokens=1, temperature=0, n=2, logprobs=1,
                                                     prompt_logprobs=2))
        plain = engine.generate(ids, SamplingParams(max_new_tokens=1, temperature=0, logprobs=1))
    prompt = scored.prompt_logprobs
    assert prompt is not None and prompt.first.token == engine.decode(ids[:1]) and plain.prompt_logprobs is None
    assert len(prompt.scored) == len(ids) - 1 and all(len(e.top_logprobs) == 2 for e in prompt.scored)
    # The echo's text and entries stay out of the choices: each is what the same request without scoring gives.
    for choice in scored.choices:
        assert (choice.text, choice.token_ids) == (plain.choices[0].text, plain.choices[0].token_ids)
        assert choice.logprobs is not None and len(choice.logprobs) == 1 and len(choice.logprobs[0].top_logprobs) == 1
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.inference_mode():
        expected = model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
    for position, (entry, token) in enumerate(zip(prompt.scored, ids[1:], strict=True)):
        assert entry.logprob == pytest.approx(expected[position, token].item(), abs=1e-4)
        assert entry.top_logprobs[0].logprob == pytest.approx(expected[position].max().item(), abs=1e-4)
