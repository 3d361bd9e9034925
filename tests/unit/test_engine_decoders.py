"""Decoders in the continuous batcher: greedy equals HF `generate`, on the llama-family runner and the general one.

Each llama-family variant of tests/tiny_llama.py (head counts, GQA/MQA, tied and untied heads, rope theta/linear/
llama3/yarn/dynamic, qwen2 biases, qwen3 q/k norms, sliding windows shorter than the prompts) and each of today's
other architectures the general runner serves (Gemma 2 and 3, Phi-3, OLMo 2, Granite, Mixtral, Qwen3-MoE, gpt-oss)
serves a batch of prompts of mixed lengths (accents and emoji included) in one prefill; each row equals HF
generating it alone. A LoRA adapter of each of today's architectures, served merged, equals HF + PEFT.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from core.adapters import AdapterConfig
from tests.tiny_adapters import make_adapters, peft_model
from tests.tiny_llama import TODAYS, VARIANTS, build_tiny_decoder
from worker.engines.generation.caches import paged_attention
from worker.engines.generation.engine import GenerationEngine, SamplingParams
from worker.engines.models.adapters import export_merged

PROMPTS = [
    "First Citizen:",
    "Before we proceed any further, hear me speak. You are all resolved rather to die than to famish?",
    "Café naïve — déjà vu 🤖🎉 über",
    "O",
]
WAIT = 60
ADAPTER = AdapterConfig(r=4, alpha=8, target_modules="all-linear")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    """Each variant built once per module, lazily: name -> (folder, fp32 HF model, tokenizer)."""
    root = tmp_path_factory.mktemp("decoders")
    cache: dict[str, tuple[Path, PreTrainedModel, PreTrainedTokenizerFast]] = {}

    def get(name: str) -> tuple[Path, PreTrainedModel, PreTrainedTokenizerFast]:
        if name not in cache:
            model, tokenizer = build_tiny_decoder(name, root / name)
            if getattr(model.config, "attn_logit_softcapping", None):
                # transformers' SDPA path drops Gemma 2's score soft-capping; its eager attention is the model
                model = AutoModelForCausalLM.from_pretrained(root / name, attn_implementation="eager").eval()
            cache[name] = (root / name, model, tokenizer)
        return cache[name]

    return get


def hf_greedy(model: PreTrainedModel, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(ids):].tolist()


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0)


@pytest.mark.parametrize("chunk", [512, 5])  # 5: chunked prefill, every prompt but "O" in several chunks
@pytest.mark.parametrize("name", [*VARIANTS, *TODAYS])
def test_greedy_equals_hf_generate_for_mixed_prompts_in_one_batch(built, name, chunk) -> None:
    assert_mixed_batch_equals_hf(built, name, chunk)


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama3"])
def test_the_general_runner_serves_llama_family_models_equal_to_hf_too(built, name) -> None:
    # The built-in runner's reference: transformers' own model over the same cache (runner="general").
    assert_mixed_batch_equals_hf(built, name, 5, runner="general")


@pytest.mark.parametrize("name", list(TODAYS))
def test_a_lone_request_equals_hf_generate(built, name) -> None:
    folder, model, tokenizer = built(name)
    with GenerationEngine(folder, device="cpu", precision="fp32", max_batch_size=2) as engine:
        choice = engine.generate(PROMPTS[1], greedy(16)).choices[0]
    assert choice.token_ids == hf_greedy(model, tokenizer(PROMPTS[1])["input_ids"], 16)


@pytest.mark.parametrize("name", list(TODAYS))
def test_a_lora_adapter_served_merged_equals_hf_and_peft(built, name, tmp_path) -> None:
    # Over a base the llama-family runner does not run, an adapter is served as its merged model (served_models.py).
    folder, _, tokenizer = built(name)
    adapter = make_adapters(folder, tmp_path, {"wide": ADAPTER})["wide"]
    tokenizer.save_pretrained(adapter)
    merged = export_merged(adapter, tmp_path / "merged")
    reference = peft_model(folder, adapter)
    if getattr(reference.config, "attn_logit_softcapping", None):
        reference.base_model.model.config._attn_implementation = "eager"
        reference.base_model.model.set_attn_implementation("eager")
    with GenerationEngine(merged, device="cpu", precision="fp32", max_batch_size=4) as engine:
        futures = [engine.submit(p, greedy(12)) for p in PROMPTS[:3]]
        results = [f.result(WAIT) for f in futures]
    plain = []
    for prompt, result in zip(PROMPTS[:3], results, strict=True):
        ids = tokenizer(prompt)["input_ids"]
        assert result.choices[0].token_ids == hf_greedy(reference, ids, 12), (name, prompt)
        plain.append(hf_greedy(built(name)[1], ids, 12))
    assert plain != [r.choices[0].token_ids for r in results]  # the adapter changed what the model says


@pytest.mark.parametrize("name", [*VARIANTS, *TODAYS])
def test_the_gathered_decode_path_equals_hf_generate(built, name, monkeypatch) -> None:
    # Where the paged kernel is not built (or on a GPU) decode steps gather the rows' blocks for SDPA.
    monkeypatch.setattr(paged_attention, "kernel", lambda: None)
    assert_mixed_batch_equals_hf(built, name, 512)


def assert_mixed_batch_equals_hf(built, name: str, chunk: int, runner: str = "auto") -> None:
    folder, model, tokenizer = built(name)
    lengths = [20, 9, 16, 24]
    streamed: dict[int, list[str]] = {i: [] for i in range(len(PROMPTS))}
    with GenerationEngine(folder, device="cpu", precision="fp32", max_batch_size=8,
                          prefill_chunk_tokens=chunk, runner=runner) as engine:
        assert engine.context_length == model.config.max_position_embeddings
        with engine._lock:  # everything queued meanwhile is admitted together: one batched prefill
            futures = [engine.submit(p, greedy(n), on_token=lambda _, d, i=i: streamed[i].append(d))
                       for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))]
        results = [f.result(WAIT) for f in futures]
        assert (engine.stats()["prefills"] == 1) == (chunk == 512)
    for index, (prompt, result) in enumerate(zip(PROMPTS, results, strict=True)):
        ids = tokenizer(prompt)["input_ids"]  # with BOS for the Llama-2-style tokenizer, as the engine encodes
        choice = result.choices[0]
        assert result.prompt_tokens == len(ids)
        assert choice.token_ids == hf_greedy(model, ids, lengths[index]), (name, prompt)
        assert choice.text == tokenizer.decode(choice.token_ids, skip_special_tokens=True)
        assert "".join(streamed[index]) == choice.text


def test_sliding_window_is_applied(built, tmp_path) -> None:
    # Without the window the same weights continue a long prompt differently: the window is live, and equal to HF's.
    folder, _, tokenizer = built("mistral")
    unwindowed = tmp_path / "full"
    shutil.copytree(folder, unwindowed)
    config = json.loads((unwindowed / "config.json").read_text())
    (unwindowed / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    outputs = []
    for path in (folder, unwindowed):
        with GenerationEngine(path, device="cpu", precision="fp32") as engine:
            outputs.append(engine.generate(PROMPTS[1], greedy(12)).choices[0].token_ids)
    assert outputs[0] != outputs[1]


def test_eos_ids_from_generation_config_may_be_a_list(built, tmp_path) -> None:
    folder, model, tokenizer = built("llama")
    ids = tokenizer(PROMPTS[0])["input_ids"]
    free = hf_greedy(model, ids, 8)
    stopper = next(t for t in free[2:] if t not in free[:2])  # a token the model emits later, not earlier
    copy = tmp_path / "eos-list"
    shutil.copytree(folder, copy)
    generation = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [2, stopper]}))
    with GenerationEngine(copy, device="cpu", precision="fp32") as engine:
        assert engine.eos_token_ids == frozenset({2, stopper})
        choice = engine.generate(PROMPTS[0], greedy(8)).choices[0]
    assert choice.finish_reason == "eos" and choice.token_ids == free[:free.index(stopper) + 1]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_bf16_weights_follow_fp32(built, name) -> None:
    folder, model, tokenizer = built(name)
    with GenerationEngine(folder, device="cpu", precision="bf16") as engine:
        assert engine.plan.precision == "bf16"
        choice = engine.generate(PROMPTS[1], greedy(4)).choices[0]
    ids = tokenizer(PROMPTS[1])["input_ids"]
    assert choice.token_ids[:2] == hf_greedy(model, ids, 2)  # bf16 keeps 8 bits: the first tokens agree


def test_other_model_types_are_refused_by_name(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "architectures": ["T5Model"]}))
    with pytest.raises(ValueError, match="model_type 't5' .* is not a causal language model"):
        GenerationEngine(tmp_path, device="cpu", precision="fp32")


def test_a_llama_without_a_fast_tokenizer_is_refused(built, tmp_path) -> None:
    folder, _, _ = built("llama")
    copy = tmp_path / "no-tokenizer"
    shutil.copytree(folder, copy)
    (copy / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        GenerationEngine(copy, device="cpu", precision="fp32")
