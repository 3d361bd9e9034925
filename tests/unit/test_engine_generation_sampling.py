"""Sampling pieces of the generation engine against HF's logits processors, and streamed text with stops."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2TokenizerFast
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tests.tiny_lm import ASSETS_TOKENIZER
from worker.engines.generation.sampling.detokenize import BytePieces, token_bytes
from worker.engines.generation.sampling.sampler import (
    RowParams,
    SamplingParams,
    counter_uniforms,
    next_tokens,
    penalize,
    truncated_distribution,
)
from worker.engines.generation.sampling.text_stream import TextStream

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer() -> GPT2TokenizerFast:
    return GPT2TokenizerFast.from_pretrained(ASSETS_TOKENIZER)


@pytest.fixture(scope="module")
def table(tokenizer) -> list[bytes]:
    return token_bytes(tokenizer, 50257)


def test_top_k_then_top_p_match_hf_warpers() -> None:
    torch.manual_seed(0)
    peaked, flat = torch.randn(4, 50257) * 4, torch.randn(2, 50257) * 0.05  # flat rows overflow the candidates
    logits = torch.cat([peaked, flat])
    settings = [(0, 0.9), (50, 1.0), (50, 0.8), (3, 0.99), (0, 0.5), (400, 0.7)]
    top_k = torch.tensor([k for k, _ in settings])
    top_p = torch.tensor([p for _, p in settings])
    probs, ids = truncated_distribution(logits, top_k, top_p)
    dense = torch.zeros_like(logits).scatter(1, ids, probs)
    for row, (k, p) in enumerate(settings):
        scores = logits[row: row + 1].clone()
        if k:
            scores = TopKLogitsWarper(k)(None, scores)
        if p < 1:
            scores = TopPLogitsWarper(p)(None, scores)
        expected = scores.softmax(dim=-1)[0]
        assert torch.equal(dense[row] > 0, expected > 0), f"row {row}: kept sets differ"
        torch.testing.assert_close(dense[row], expected, atol=1e-6, rtol=1e-4)


def test_repetition_penalty_matches_hf() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 100)
    history = torch.tensor([[3, 7, 7, 50], [0, 99, 42, 3]])
    seen = torch.zeros(2, 100, dtype=torch.bool).scatter(1, history, True)
    ours = penalize(logits, seen, torch.tensor([[1.3], [1.3]]))
    assert torch.equal(ours, RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone()))


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_the_batch() -> None:
    torch.manual_seed(2)
    mine = torch.randn(1, 1000) * 2
    params = SamplingParams(temperature=0.7, top_k=100, top_p=0.95, seed=11)
    alone = RowParams([params], CPU, seeds=[11])
    crowd = RowParams([SamplingParams(temperature=0), SamplingParams(temperature=1.5), params], CPU,
                      seeds=[None, 99, 11])
    for _ in range(20):
        others = torch.randn(2, 1000)
        solo = next_tokens(mine, alone, None)
        batch = next_tokens(torch.cat([others, mine]), crowd, None)
        assert batch[0] == others[0].argmax() and batch[2] == solo[0]


def test_a_row_joining_mid_sequence_continues_its_own_noise() -> None:
    # A row rebuilt into another batch at counter k draws what it would have drawn staying where it was.
    torch.manual_seed(3)
    logits = torch.randn(1, 500)
    params = SamplingParams(temperature=1.0, seed=42)
    steady = RowParams([params], CPU, seeds=[42])
    drawn = [int(next_tokens(logits, steady, None)[0]) for _ in range(6)]
    for k in range(6):
        crowd = RowParams([SamplingParams(seed=1), params, SamplingParams(temperature=0)], CPU,
                          seeds=[1, 42, None], counters=[0, k, 0])
        logits3 = torch.cat([torch.randn(1, 500), logits, torch.randn(1, 500)])
        assert int(next_tokens(logits3, crowd, None)[1]) == drawn[k]


def test_counter_uniforms_are_splitmix64_and_uniform() -> None:
    def splitmix(x: int) -> int:  # the reference SplitMix64 finaliser on Python integers
        mask = (1 << 64) - 1
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    seeds = [0, 1, 7, 2**62 + 12345, 2**63 - 1]
    counters = [0, 3, 1000, 5, 63]
    got = counter_uniforms(torch.tensor(seeds), torch.tensor(counters))
    mask = (1 << 64) - 1
    expected = [(splitmix((splitmix(s) + c) & mask) >> 40) / 2**24 for s, c in zip(seeds, counters, strict=True)]
    assert got.tolist() == expected
    many = counter_uniforms(torch.full((20000,), 5), torch.arange(20000))
    assert 0 <= float(many.min()) and float(many.max()) < 1 and abs(float(many.mean()) - 0.5) < 0.01


def test_draws_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125, 0.0]]))
    rows = RowParams([SamplingParams()], CPU, seeds=[0])
    counts = torch.bincount(torch.cat([next_tokens(logits, rows, None) for _ in range(4000)]),
                            minlength=5)
    assert counts[4] == 0
    torch.testing.assert_close(counts[:4] / 4000, torch.tensor([0.5, 0.25, 0.125, 0.125]), atol=0.03, rtol=0)


def test_multibyte_characters_are_never_split(tokenizer, table) -> None:
    text = "naïve café ✓ 日本語 🤖!"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # some characters span several byte tokens
    stream = TextStream(BytePieces(table))
    deltas = [stream.push(t) for t in ids] + [stream.finish()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == stream.text == text


def test_incomplete_bytes_at_the_end_decode_like_the_tokenizer(tokenizer, table) -> None:
    ids = tokenizer.encode("🤖")[:-1]  # cut inside the character
    stream = TextStream(BytePieces(table))
    text = "".join(stream.push(t) for t in ids) + stream.finish()
    assert text == stream.text == tokenizer.decode(ids)


@pytest.mark.parametrize(
    ("pieces", "stops", "text", "stopped"),
    [
        (["Hello", " wor", "ld", "!"], ("world",), "Hello ", True),
        (["ab", "c", "d"], ("cd", "bc"), "a", True),  # the earliest match wins
        (["STOP", "x"], ("STOP",), "", True),
        (["Hel", "lo"], ("lo!",), "Hello", False),  # a held-back partial match is released at the end
        (["a\n", "\nb"], ("\n\n",), "a", True),
    ],
)
def test_stop_sequences_hold_back_and_truncate(pieces, stops, text, stopped) -> None:
    table = [p.encode() for p in pieces]
    stream = TextStream(BytePieces(table), stops)
    deltas = []
    for index in range(len(pieces)):
        deltas.append(stream.push(index))
        if stream.stopped:
            break
    deltas.append(stream.finish())
    assert (stream.text, stream.stopped, "".join(deltas)) == (text, stopped, text)
    assert not any(s in d for d in deltas for s in stops)


def test_sampling_params_coerce_and_reject() -> None:
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")  # a JSON list is fine
    for bad in (dict(stop="abc"), dict(top_k=True), dict(seed=-1), dict(temperature=float("nan")),
                dict(top_p=1.5), dict(max_new_tokens=2.0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
