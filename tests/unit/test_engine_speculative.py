"""Speculative decoding with prompt-lookup drafts: greedy output equal token for token to plain decoding and to HF
`generate` (GPT-2 and a llama-family decoder, fp32, alone and several rows at once, adapters included), sampled
output equal draw for draw (same seeds) to plain decoding, drafts really kept, requests that must not speculate
(opted out, constrained, with logprobs) decoding one token a step, and the pricing of draft tokens from measured
step times and each row's acceptance rate."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.protocol import Constraint, SamplingParams
from tests.tiny_chat import build_tiny_llama
from worker.engines.generation import speculative
from worker.engines.generation.engine import GenerationEngine
from worker.engines.generation.requests import SequenceState
from worker.engines.generation.speculative import (
    RATES_DECAY,
    DraftRates,
    Proposal,
    StepCosts,
    accepted,
    lengths,
    propose,
)

REPEATING = [11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 15, 16, 11, 12, 13]  # an input the answer is likely to echo


def test_propose_takes_what_followed_the_most_recent_longest_match():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == ([7, 1], 3)  # "1 2 3" last seen before 7
    assert propose([5, 6, 7, 5, 6], 3) == ([7, 5, 6], 2)
    assert propose([1, 2, 3, 4], 3) == ([], 0)  # the suffix occurs nowhere earlier
    assert propose([4, 4], 5) == ([4], 1)


def longest_recent_match(history: list[int], k: int, max_ngram: int = 4) -> tuple[list[int], int]:
    """The definition propose() keeps: the longest suffix (up to max_ngram) found earlier with a token after it, at
    its most recent such occurrence, and the k tokens after that."""
    for n in range(min(max_ngram, len(history) - 1), 0, -1):
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == history[-n:]:
                return history[start + n:start + n + k], n
    return [], 0


def test_propose_finds_what_the_definition_finds():
    """propose() searches by the last token's occurrences (list.index in C), not every suffix length at every
    position: the same proposal, on histories of few distinct tokens (many partial matches) and of none repeated."""
    rng = random.Random(0)
    for _ in range(3000):
        history = [rng.randrange(rng.choice([2, 3, 6, 50])) for _ in range(rng.randrange(0, 40))]
        k = rng.randrange(1, 9)
        assert tuple(propose(history, k)) == longest_recent_match(history, k), history


def test_accepted_keeps_agreeing_drafts_then_the_models_token():
    assert accepted([7, 8, 9], [7, 8, 5, 1]) == [7, 8, 5]
    assert accepted([7, 8], [7, 8, 6]) == [7, 8, 6]  # all kept, plus the token after them
    assert accepted([], [4]) == [4]
    assert accepted([7], [3, 9]) == [3]


def chances(rate: float, count: int = 8) -> list[float]:
    """A proposal's expected yields when each draft token is right with `rate` given the ones before it."""
    return [rate ** j for j in range(1, count + 1)]


def test_lengths_spend_positions_where_they_pay():
    half = chances(0.5)
    assert lengths([half] * 2, None, None) == [0, 0]  # this row count's plain step is not measured yet
    # Nor is a draft position: the likeliest draft tokens are checked, one proposal's worth in all (that measures it).
    assert lengths([half] * 2, 0.05, None) == [4, 4]
    assert lengths([chances(0.9), chances(0.2), half[:3]], 0.05, None) == [7, 0, 1]
    assert lengths([half[:3], chances(0.4, 2)], 0.05, None) == [2, 1]
    # Beside one row a position is nearly free (the weights are read once): a good row checks its whole draft, even
    # a poor one checks a few.
    assert lengths([chances(0.9)], 0.05, 0.0005) == [8]
    assert 0 < lengths([chances(0.3)], 0.05, 0.0005)[0] < 8
    # Sixteen rows on a CPU (a decode step 77 ms, each checked position 2.4 ms more): only rows whose drafts are
    # usually right check any, and a likelier row checks more; rows that are usually wrong decode plainly.
    yields = [chances(0.95)] * 4 + [chances(0.6)] * 4 + [chances(0.1)] * 8
    taken = lengths(yields, 0.077, 0.0024)
    assert taken[0] > taken[4] >= 0 and taken[:4] == [taken[0]] * 4 and taken[8:] == [0] * 8
    assert lengths([chances(0.3)] * 16, 0.077, 0.0024) == [0] * 16  # nothing pays: a plain step


def test_draft_rates_follow_the_matched_context_and_each_rows_record():
    """A draft token after a long match is counted apart from one after a one-token match, a draft's later tokens
    at the longer contexts their right predecessors make, and a row whose drafts fail more than the rates say is
    expected to yield less."""
    rates = DraftRates()
    assert rates.rate(1) == rates.rate(4) == 0.5  # the prior
    steady, erratic = (SequenceState(request=None, index=0, stream=None, seed=None)  # type: ignore[arg-type]
                       for _ in range(2))
    for _ in range(40):
        rates.record(steady, Proposal([1, 2, 3], 4), [1, 2, 3], [1, 2, 3, 9])  # after 4 matched tokens: all right
        rates.record(steady, Proposal([5, 6], 1), [5, 6], [7])  # after a 1-token match: the first is wrong
    assert rates.rate(4) > 0.9 and rates.rate(6) > 0.9 and rates.rate(1) < 0.1
    assert rates.checked[2] == 0  # a wrong first token: its successor was never reached
    long_match = Proposal([1, 2, 3, 4], 4)
    assert rates.yields(steady, long_match)[0] > 0.9
    assert rates.yields(steady, long_match) == sorted(rates.yields(steady, long_match), reverse=True)
    for _ in range(5):
        rates.record(erratic, Proposal([1, 2], 4), [1, 2], [8])  # where the rates say right, this row is wrong
    assert rates.yields(erratic, long_match)[0] < 0.5 * rates.yields(steady, long_match)[0]


def test_draft_rates_decay_every_earlier_count_once_per_checked_token():
    """One record of three checked tokens weighs as three records of one: each count decays by RATES_DECAY for
    every draft token checked after it."""
    row = SequenceState(request=None, index=0, stream=None, seed=None)  # type: ignore[arg-type]
    rates = DraftRates()
    rates.record(row, Proposal([5], 1), [5], [5, 9])  # an earlier count, at context 1
    rates.record(row, Proposal([1, 2, 3], 2), [1, 2, 3], [1, 2, 7])  # two right, the third wrong
    assert rates.checked[1] == pytest.approx(RATES_DECAY**3)
    assert rates.checked[2:5] == pytest.approx([RATES_DECAY**2, RATES_DECAY, 1.0])
    assert rates.right[2:5] == pytest.approx([RATES_DECAY**2, RATES_DECAY, 0.0])


def test_step_costs_fit_one_line_through_plain_and_speculative_steps():
    costs = StepCosts()
    assert costs.price(4) == (None, None)  # nothing measured: decode plainly
    costs.observe(tokens=4, seconds=0.1)
    assert costs.price(4) == (pytest.approx(0.1), None)  # one token count: what a token adds is unknown
    for tokens in (4, 12, 20, 4, 8) * 10:  # a step costs 60 ms plus 10 ms a token, plain or speculative
        costs.observe(tokens=tokens, seconds=0.06 + 0.01 * tokens)
    decode_s, position_s = costs.price(16)
    assert decode_s == pytest.approx(0.22) and position_s == pytest.approx(0.01)
    costs.observe(tokens=5, seconds=1.0)  # one stalled step moves the fit a little, not the price of every token
    assert costs.price(16)[1] == pytest.approx(0.01, rel=0.5)
    for _ in range(200):  # a workload that never speculates again keeps the line current from plain steps
        for tokens in (12, 16):
            costs.observe(tokens=tokens, seconds=0.02 + 0.005 * tokens)
    assert costs.price(16)[1] == pytest.approx(0.005, rel=0.05)
    for _ in range(400):  # plain steps of one row count alone cannot tell the slope: it is unknown again (explored)
        costs.observe(tokens=16, seconds=0.1)
    assert costs.price(16) == (pytest.approx(0.1, rel=1e-3), None)


def greedy(new: int = 40, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=new, temperature=0.0, **kwargs)


def hf_greedy(model_dir: Path, prompt: list[int], new: int) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=new, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    eos = hf.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    for i, token in enumerate(tokens):  # HF pads after eos; the engine's tokens end with it
        if token in eos_ids:
            return tokens[:i + 1]
    return tokens


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("spec-llama") / "llama", seed=5)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_greedy_output_is_the_same_with_drafts_and_equals_hf(arch, tiny_gpt2_dir, llama_dir):
    model_dir = tiny_gpt2_dir if arch == "gpt2" else llama_dir
    prompts = [REPEATING, REPEATING[3:] + [21, 22], [30, 31, 30, 31, 30]]
    results = {}
    for k in (0, 4):
        with GenerationEngine(model_dir, device="cpu", precision="fp32", max_batch_size=4,
                              speculative_tokens=k) as engine:
            with engine._lock:  # all three decode together: drafts checked for several rows in one forward
                futures = [engine.submit(p, greedy()) for p in prompts]
            results[k] = [f.result(timeout=120).choices[0].token_ids for f in futures]
            alone = engine.generate(prompts[0], greedy()).choices[0].token_ids
            stats = engine.stats()
        assert alone == results[k][0]
        if k:  # drafts were checked; the tiny GPT-2 echoes its input, so some were kept: fewer forwards than tokens
            assert stats["speculative_steps"] > 0, stats
            if arch == "gpt2":
                assert stats["accepted_draft_tokens"] > 0 and stats["steps"] < stats["generated_tokens"], stats
    assert results[4] == results[0]
    assert results[0][0] == hf_greedy(model_dir, prompts[0], 40)


def test_adapter_rows_speculate_with_their_adapter(llama_dir, tmp_path):
    from core.adapters import AdapterConfig
    from worker.engines.training import adapters

    torch.manual_seed(0)
    model = adapters.apply_adapter(AutoModelForCausalLM.from_pretrained(llama_dir),
                                   AdapterConfig(r=4, alpha=8, target_modules="all-linear"), "causal-lm")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(tmp_path / "adapter")
    outputs = {}
    for k in (0, 4):
        with GenerationEngine(llama_dir, device="cpu", precision="fp32", max_batch_size=4, speculative_tokens=k,
                              adapter_folder=lambda name: tmp_path / name) as engine:
            with engine._lock:
                futures = [engine.submit(REPEATING, greedy(), adapter="adapter"), engine.submit(REPEATING, greedy())]
            outputs[k] = [f.result(timeout=120).choices[0].token_ids for f in futures]
    assert outputs[4] == outputs[0] and outputs[0][0] != outputs[0][1]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_steps_that_prefill_prompt_chunks_check_drafts_too(arch, tiny_gpt2_dir, llama_dir, monkeypatch):
    """Prompts prefilled in small chunks while others decode: those steps check the decoding rows' drafts in the same
    forward, and rows that a step's ended prompt opens take their first token there; every answer (greedy and
    seeded sampled) is the one plain decoding gives."""
    monkeypatch.setattr(speculative, "lengths", lambda yields, *_: [len(y) for y in yields])  # check drafts whole
    model_dir = tiny_gpt2_dir if arch == "gpt2" else llama_dir
    settings = [greedy(), SamplingParams(max_new_tokens=40, temperature=0.8, seed=3, n=2), greedy(30)]
    prompts = [REPEATING, [30, 31, 30, 31, 30, 31, 30, 31, 30, 31, 30], REPEATING[2:] * 2]
    results, mixed = {}, []
    for k in (0, 4):
        with GenerationEngine(model_dir, device="cpu", precision="fp32", max_batch_size=8, speculative_tokens=k,
                              prefill_chunk_tokens=7) as engine:
            schedule = engine.scheduler.schedule

            def traced(*args, schedule=schedule, **kwargs):
                plan = schedule(*args, **kwargs)
                if plan.drafts and plan.prefill:  # a step that checks drafts beside prompt chunks
                    mixed.append(len(plan.prefill))
                return plan

            monkeypatch.setattr(engine.scheduler, "schedule", traced)
            with engine._lock:
                futures = [engine.submit(p, params) for p, params in zip(prompts, settings, strict=True)]
            results[k] = [[c.token_ids for c in f.result(timeout=120).choices] for f in futures]
    assert mixed, "no step checked drafts beside a prompt chunk"
    assert results[4] == results[0]


def test_requests_that_must_not_speculate_decode_one_token_a_step(tiny_gpt2_dir):
    with GenerationEngine(tiny_gpt2_dir, device="cpu", precision="fp32", max_batch_size=4,
                          speculative_tokens=4) as engine:
        for params in (greedy(30, logprobs=2),
                       greedy(30, speculative=False),
                       greedy(30, constraint=Constraint(kind="regex", spec="[a-z ]{1,40}"))):
            before = engine.stats()["speculative_steps"]
            engine.generate(REPEATING, params)
            assert engine.stats()["speculative_steps"] == before, params


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_sampled_output_is_the_same_with_drafts_seed_for_seed(arch, tiny_gpt2_dir, llama_dir, monkeypatch):
    """A sampled row keeps a draft while it equals the draw plain decoding would make with that token's own uniform,
    so with drafts on, every seeded answer (alone, beside greedy and other sampled rows, top-k and top-p included) is
    the one plain decoding gives, and some drafts were kept. Every proposal is checked whole: how many positions the
    step-cost pricing would take depends on this machine's timings, and the test must not."""
    monkeypatch.setattr(speculative, "lengths", lambda proposals, *_: [len(p) for p in proposals])
    model_dir = tiny_gpt2_dir if arch == "gpt2" else llama_dir
    settings = [SamplingParams(max_new_tokens=40, temperature=0.3, seed=7),
                SamplingParams(max_new_tokens=40, temperature=0.8, top_p=0.9, seed=8),
                SamplingParams(max_new_tokens=40, temperature=1.0, top_k=5, seed=9, n=2),
                greedy()]
    prompts = [REPEATING, REPEATING[3:] + [21, 22], [30, 31, 30, 31, 30], REPEATING]
    results, stats = {}, {}
    for k in (0, 4):
        with GenerationEngine(model_dir, device="cpu", precision="fp32", max_batch_size=8,
                              speculative_tokens=k, speculative_max_rows=8) as engine:
            with engine._lock:
                futures = [engine.submit(p, params) for p, params in zip(prompts, settings, strict=True)]
            results[k] = [[c.token_ids for c in f.result(timeout=120).choices] for f in futures]
            results[k].append([engine.generate(REPEATING, settings[0]).choices[0].token_ids])  # alone
            stats[k] = engine.stats()
    assert results[4] == results[0]
    assert results[0][-1] == results[0][0]  # alone as in the batch: the draws depend on the seed only
    assert stats[4]["speculative_steps"] > 0, stats[4]
    if arch == "gpt2":  # the tiny GPT-2 echoes its input, so some sampled drafts were kept
        assert stats[4]["accepted_draft_tokens"] > 0, stats[4]
