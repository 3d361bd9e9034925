"""Incremental detokenization: streamed pieces reassemble to `decode(ids, skip_special_tokens=True)` exactly.

Both tokenizers are trained in tests/tiny_llama.py from examples/data: a Llama-2-style one (Metaspace, byte
fallback, `<0xNN>` tokens, Llama 2's decoder chain) and a byte-level BPE. Random id sequences cover byte
runs that are not valid UTF-8, special tokens mid-sequence and tokens that decode to nothing.
"""

from __future__ import annotations

import random

import pytest

from tests.tiny_llama import save_tokenizer
from worker.engines.generation.sampling.detokenize import BYTE_TOKEN, BytePieces, WindowPieces, piece_decoders
from worker.engines.generation.sampling.text_stream import TextStream
from worker.engines.generation.tokenizer import load_tokenizer

TEXTS = ["Café naïve — déjà vu 🤖🎉 über", "Ünïcödé: 日本語 and ✓ marks", "plain words, then 🎉", " lead space"]


@pytest.fixture(scope="module", params=["metaspace", "bytelevel"])
def tokenizer(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    save_tokenizer(request.param, folder)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return load_tokenizer(folder)  # as the engine loads it: PreTrainedTokenizerFast from tokenizer.json


def stream(tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], TextStream]:
    text = TextStream(piece_decoders(tokenizer, len(tokenizer))(), stop)
    deltas = []
    for token in ids:
        deltas.append(text.push(token))
        if text.stopped:
            break
    deltas.append(text.finish())
    return deltas, text


def test_each_tokenizer_gets_its_decoder(tokenizer) -> None:
    pieces = piece_decoders(tokenizer, len(tokenizer))()
    kind = "bytelevel" if "Ġ" in "".join(tokenizer.get_vocab()) else "metaspace"
    assert isinstance(pieces, BytePieces if kind == "bytelevel" else WindowPieces)


@pytest.mark.parametrize("text", TEXTS)
def test_accents_and_emoji_stream_whole_characters_and_reassemble(tokenizer, text) -> None:
    ids = tokenizer(text)["input_ids"]
    if "🎉" in text and isinstance(piece_decoders(tokenizer, len(tokenizer))(), WindowPieces):
        assert any(BYTE_TOKEN.match(t) for t in tokenizer.convert_ids_to_tokens(ids))  # emoji via byte fallback
    deltas, result = stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)  # no character is ever split across pieces
    assert "".join(deltas) == result.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert result.text.strip() == text.strip()


def test_random_ids_reassemble_to_decode(tokenizer) -> None:
    # Random models emit anything: invalid byte runs, specials mid-text, lone continuation bytes.
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(400):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 24))]
        deltas, result = stream(tokenizer, ids)
        assert "".join(deltas) == result.text == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_stops_still_apply_to_the_decoded_text(tokenizer) -> None:
    ids = tokenizer("déjà vu 🤖 then more")["input_ids"]
    deltas, result = stream(tokenizer, ids, stop=("🤖",))
    assert result.stopped and result.text == "".join(deltas) == "déjà vu "
