"""Structured output and logprobs in the batched engine, from tiny random GPT-2s (and a Llama-2-style tokenizer).

A random model is the hardest client of a grammar: it wants nothing in particular, so every output below
is valid only because the mask made it so.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import GPT2LMHeadModel, GPT2TokenizerFast, LlamaTokenizerFast

from core.paths import GPT2_TOKENIZER_DIR
from core.protocol import Constraint
from tests.tiny_lm import build_tiny_gpt2
from worker.engines.generation.engine import GenerationEngine, SamplingParams
from worker.engines.generation.sampling.grammar import GrammarError, Grammars, allowed_tokens

WAIT = 60
REPO = Path(__file__).resolve().parents[2]
# Bounded: a short string, enums, bounded integers, an array with maxItems, a nested object, required, no others.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                   "score": {"type": "integer", "minimum": -5, "maximum": 5}},
                  "required": ["ok", "score"], "additionalProperties": False},
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}
SCHEMA_TOKENS = 80  # far more than the longest output of SCHEMA in GPT-2 tokens


def schema_of(schema: dict) -> Constraint:
    return Constraint(kind="json_schema", spec=json.dumps(schema))


def build_llama_tokenizer(vocab_size: int = 600) -> LlamaTokenizerFast:
    """A Llama-2-style tokenizer trained here: Metaspace ("▁") via the normalizer, BPE with byte fallback."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    lines = (REPO / "examples/data/tinyshakespeare.txt").read_text().splitlines()[:3000]
    tokenizer.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                             show_progress=False))
    # As in Llama-2's tokenizer.json the byte tokens are plain vocabulary, not added (special) tokens.
    data = json.loads(tokenizer.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if not t["content"].startswith("<0x")]
    return LlamaTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), bos_token="<s>",
                              eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_gpt2(tmp_path_factory.mktemp("structured") / "m", seed=3, n_positions=256)


@pytest.fixture(scope="module")
def engine(model_dir):
    with GenerationEngine(model_dir, device="cpu", precision="fp32", max_batch_size=8) as engine:
        yield engine


def _walk(grammars: Grammars, constraint: Constraint, vocab: int, eos: int, seed: int, steps: int = 400) -> list[int]:
    """A uniformly random choice among the allowed tokens at every step: the most adversarial model."""
    matcher, rng, out = grammars.matcher(constraint), random.Random(seed), []
    for _ in range(steps):
        allowed = allowed_tokens([matcher], vocab)[0].nonzero()[:, 0].tolist()
        token = rng.choice(allowed)
        matcher.consume_token(token)
        if token == eos:
            return out
        out.append(token)
    raise AssertionError(f"no eos within {steps} tokens: {out}")


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_random_walks_through_the_mask_are_valid_on_byte_level_and_byte_fallback_tokenizers(which) -> None:
    if which == "gpt2":
        tokenizer, eos = GPT2TokenizerFast.from_pretrained(GPT2_TOKENIZER_DIR), 50256
    else:
        tokenizer = build_llama_tokenizer()
        eos = tokenizer.eos_token_id
    grammars = Grammars(tokenizer, len(tokenizer), [eos])
    for seed in range(8):
        ids = _walk(grammars, schema_of(SCHEMA), len(tokenizer), eos, seed)
        jsonschema.validate(json.loads(tokenizer.decode(ids)), SCHEMA)
    assert grammars.cached == 1  # compiled once, copied per sequence


def _run(engine, constraint: Constraint, temperature: float, n: int = 3, max_new_tokens: int = SCHEMA_TOKENS):
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=11, n=n,
                            constraint=constraint)
    return engine.submit("The answer:", params).result(timeout=WAIT).choices


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_always_validates_within_max_tokens(engine, temperature) -> None:
    for choice in _run(engine, schema_of(SCHEMA), temperature):
        assert choice.finish_reason == "eos", choice
        jsonschema.validate(json.loads(choice.text), SCHEMA)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_choice_and_regex(engine, temperature) -> None:
    options = ["yes", "no", "it depends, Ünïcode 🙂"]
    for choice in _run(engine, Constraint(kind="choice", spec=json.dumps(options)), temperature, max_new_tokens=30):
        assert choice.text in options and choice.finish_reason == "eos"
    for choice in _run(engine, Constraint(kind="regex", spec=r"[0-9]{3}-[a-z]{2,4}"), temperature):
        assert choice.finish_reason == "eos"
        assert len(choice.text) <= 8 and choice.text[3] == "-" and choice.text[:3].isdigit(), choice.text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_object_parses_when_it_ends_and_is_cut_as_length(engine, temperature) -> None:
    # Any JSON object is unbounded (a random model may write a string forever): a cut says "length".
    choices = _run(engine, Constraint(kind="json_object"), temperature, n=4, max_new_tokens=150)
    for choice in choices:
        if choice.finish_reason == "eos":
            assert isinstance(json.loads(choice.text), dict)
        else:
            assert choice.finish_reason == "length" and choice.text.startswith("{")


def test_a_constrained_and_a_free_request_share_a_step_and_both_are_right(engine) -> None:
    free = SamplingParams(max_new_tokens=40, temperature=0)
    solo = engine.generate("Hello there", free).choices[0]
    steps_before = engine.stats()["steps"]
    sizes: list[int] = []
    engine._loop.on_step = sizes.append  # the step loop's own batch-size hook
    try:
        constrained = engine.submit("Hello there", SamplingParams(max_new_tokens=SCHEMA_TOKENS, temperature=1.0,
                                                                  seed=5, constraint=schema_of(SCHEMA)))
        mixed = engine.submit("Hello there", free)
        jsonschema.validate(json.loads(constrained.result(timeout=WAIT).choices[0].text), SCHEMA)
        together = mixed.result(timeout=WAIT).choices[0]
    finally:
        engine._loop.on_step = None
    assert together.token_ids == solo.token_ids and together.text == solo.text
    assert engine.stats()["steps"] > steps_before and max(sizes) == 2  # both rows drew in the same steps


def test_a_schema_the_engine_cannot_enforce_is_refused_with_its_field(engine) -> None:
    with pytest.raises(GrammarError) as raised:
        engine.submit("x", SamplingParams(constraint=schema_of({"type": "array", "uniqueItems": True})))
    assert raised.value.field == "response_format"
    with pytest.raises(GrammarError) as raised:
        engine.submit("x", SamplingParams(constraint=Constraint(kind="regex", spec="(unclosed")))
    assert raised.value.field == "guided_regex"


def test_logprobs_equal_hf_log_softmax_and_hold_the_requested_count(engine, model_dir) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=0, logprobs=5)
    choice = engine.generate("To be, or not", params).choices[0]
    prompt = engine.encode("To be, or not")
    model = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + choice.token_ids])).logits[0].float()
    reference = logits.log_softmax(dim=-1)[len(prompt) - 1:-1]
    generated = [t for t in choice.token_ids if t not in engine.eos_token_ids]
    assert len(choice.logprobs) == len(generated) > 0
    for step, (entry, token) in enumerate(zip(choice.logprobs, generated, strict=True)):
        assert abs(entry.logprob - reference[step, token].item()) < 1e-3
        top_values, top_ids = reference[step].topk(5)
        assert len(entry.top_logprobs) == 5
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-3)
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [engine._loop.table[i] for i in top_ids.tolist()]
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy took the best
    zero = engine.generate("To be", SamplingParams(max_new_tokens=3, temperature=0, logprobs=0)).choices[0]
    assert all(e.top_logprobs == [] for e in zero.logprobs) and len(zero.logprobs) == 3


def test_streamed_logprobs_arrive_with_their_text(engine) -> None:
    pieces: list[tuple[str, list]] = []
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=2, logprobs=2)
    future = engine.submit("Once", params, on_token=lambda index, text, logprobs: pieces.append((text, logprobs)))
    choice = future.result(timeout=WAIT).choices[0]
    assert "".join(text for text, _ in pieces) == choice.text
    streamed = [entry for _, entries in pieces for entry in entries]
    assert streamed == choice.logprobs[:len(streamed)] and len(streamed) >= len(choice.logprobs) - 1
