"""Structured output never fails silently: on SentencePiece-style byte-fallback tokenizers as trained with the
`tokenizers` library (a plain Metaspace decoder, `<0xNN>` byte tokens listed as special added tokens), and with
grammars llguidance compiles but cannot follow (refused before generation, or an error when found mid-way)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizerFast

from core.protocol import Constraint, SamplingParams
from worker.engines.generation.engine import GenerationEngine
from worker.engines.generation.requests import GRAMMAR_ERROR
from worker.engines.generation.sampling import grammar
from worker.engines.generation.sampling.grammar import GrammarError

REPO = Path(__file__).resolve().parents[2]
WAIT = 120
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
# 600 optional properties: compiles, then the first key passes llguidance's Earley row limit (2,000 items).
WIDE = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
DECODERS = {
    "metaspace": decoders.Metaspace(replacement="\u2581", prepend_scheme="first"),
    "llama2-chain": decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)]),
}


def user_trained_llama(folder: Path, decoder: str) -> Path:
    """A tiny Llama with a tokenizer trained on tinyshakespeare as the `tokenizers` docs show: Metaspace, BPE with
    byte fallback, the 256 byte tokens passed to the trainer as special tokens (so `{` and `"` exist only as bytes)."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tokenizer.decoder = DECODERS[decoder]
    lines = (REPO / "examples/data/tinyshakespeare.txt").read_text().splitlines()[:3000]
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokenizer.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                             show_progress=False))
    fast = LlamaTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ '<s>[INST] ' + m['content'] + ' [/INST]' }}{% endfor %}"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, initializer_range=0.1)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=sorted(DECODERS))
def engine(request, tmp_path_factory):
    folder = user_trained_llama(tmp_path_factory.mktemp(request.param), request.param)
    with GenerationEngine(folder, device="cpu", precision="fp32", max_batch_size=8) as engine:
        yield engine


def _choices(engine, constraint: Constraint, temperature: float, n: int = 3):
    prompt = engine.encode_chat([{"role": "user", "content": "Who are you? Answer in JSON."}])
    params = SamplingParams(max_new_tokens=120, temperature=temperature, seed=3, n=n, constraint=constraint)
    return engine.submit(prompt, params).result(timeout=WAIT).choices


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_and_json_object_validate_on_a_byte_fallback_metaspace_llama(engine, temperature):
    """These answered "" (the matcher allowed only the end at once, and the byte tokens were dropped as special)."""
    for choice in _choices(engine, Constraint(kind="json_schema", spec=json.dumps(SCHEMA)), temperature):
        assert choice.finish_reason == "eos", choice
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    for choice in _choices(engine, Constraint(kind="json_object"), temperature):
        # Any JSON object is unbounded (a random model may write a key forever): a cut says "length".
        assert choice.text.startswith("{"), choice
        if choice.finish_reason == "eos":
            assert isinstance(json.loads(choice.text), dict), choice
        else:
            assert choice.finish_reason == "length", choice
    assert engine.tokenizer.decode(engine.tokenizer.encode('{"a": 1}'), skip_special_tokens=True) == '{"a": 1}'


def test_a_grammar_the_matcher_cannot_follow_is_refused_before_generation(engine):
    with pytest.raises(GrammarError, match="row has") as raised:
        engine.submit([1, 2, 3], SamplingParams(max_new_tokens=8, constraint=Constraint(
            kind="json_schema", spec=json.dumps(WIDE))))
    assert raised.value.field == "response_format"


def test_a_matcher_failing_mid_stream_ends_its_row_as_an_error_not_a_stop(engine, monkeypatch):
    monkeypatch.setattr(grammar, "probe", lambda *args, **kwargs: None)  # a failure the probe did not reach
    wide = json.dumps({**WIDE, "title": "mid-stream"})  # another cache entry than the refused one
    choices = _choices(engine, Constraint(kind="json_schema", spec=wide), 1.0, n=2)
    assert [c.finish_reason for c in choices] == [GRAMMAR_ERROR, GRAMMAR_ERROR]
