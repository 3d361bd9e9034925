"""GenerationEngine on tiny random GPT-2s: HF-exact greedy, continuous batching, sampling, stops, limits."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from transformers import GPT2LMHeadModel

from tests.tiny_lm import build_tiny_gpt2
from worker.engines.generation.caches import paged_attention
from worker.engines.generation.caches.paged_cache import PagedCache
from worker.engines.generation.caches.prefix_cache import BLOCK, PrefixCache, block_keys
from worker.engines.generation.engine import (
    DeadlineExceeded,
    EngineClosed,
    GenerationEngine,
    GenerationResult,
    QueueFull,
    SamplingParams,
)
from worker.engines.generation.requests import AdapterUse, Request
from worker.engines.generation.runners.gpt2 import Gpt2Runner
from worker.engines.generation.runners.gpt2_weights import load_gpt2
from worker.engines.generation.runners.runner import DecodeInput, PrefillInput

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog and",
    "To be, or not to be: that is the question. Whether 'tis nobler in the mind to suffer",
    "A",
    [464, 3290, 318],  # token ids are accepted as a prompt too
]
WAIT = 30  # seconds: generous, the machine running the tests may be busy


def greedy(max_new_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, **kwargs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"), seed=0)


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> GPT2LMHeadModel:
    return GPT2LMHeadModel.from_pretrained(model_dir).eval()


# The engines these tests compare with fp32 HF are fp32 explicitly: `auto` picks bf16 on a CPU where it pays.
@pytest.fixture(scope="module")
def engine(model_dir: Path):
    with GenerationEngine(model_dir, device="cpu", precision="fp32", max_batch_size=8) as eng:
        yield eng


@pytest.fixture(scope="module")
def narrow(model_dir: Path):
    """One sequence at a time and a queue of two: makes waiting deterministic."""
    with GenerationEngine(model_dir, device="cpu", precision="fp32", max_batch_size=1, max_queue=2) as eng:
        yield eng


def hf_greedy(hf: GPT2LMHeadModel, ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=50256, **kwargs)
    return out[0, len(ids):].tolist()


def ids_of(engine: GenerationEngine, prompt: str | list[int]) -> list[int]:
    return engine.encode(prompt) if isinstance(prompt, str) else list(prompt)


class Gate:
    """An on_token callback that blocks the scheduler on the first token until opened."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def __call__(self, index: int, delta: str) -> None:
        self.entered.set()
        assert self.opened.wait(WAIT)


def test_greedy_matches_hf_generate_for_mixed_lengths_in_one_batch(engine, hf) -> None:
    before = engine.stats()["prefills"]
    with engine._lock:  # the scheduler admits everything queued meanwhile in one go: one batched prefill
        futures = [engine.submit(p, greedy(24)) for p in PROMPTS]
    results = [f.result(WAIT) for f in futures]
    assert engine.stats()["prefills"] == before + 1
    for prompt, result in zip(PROMPTS, results, strict=True):
        ids = ids_of(engine, prompt)
        assert result.prompt_tokens == len(ids)
        assert result.choices[0].token_ids == hf_greedy(hf, ids, 24)
        assert result.choices[0].text == engine.tokenizer.decode(result.choices[0].token_ids)


def test_the_gathered_decode_path_equals_hf_generate(engine, hf, monkeypatch) -> None:
    # Where the paged kernel is not built (or on a GPU) decode steps gather the rows' blocks for SDPA.
    monkeypatch.setattr(paged_attention, "kernel", lambda: None)
    test_greedy_matches_hf_generate_for_mixed_lengths_in_one_batch(engine, hf)


@pytest.fixture(scope="module")
def chunked(model_dir: Path):
    """Prompts go into the cache 7 tokens per step: long ones take many chunks, interleaved with decode steps."""
    with GenerationEngine(model_dir, device="cpu", precision="fp32", max_batch_size=8, prefill_chunk_tokens=7) as eng:
        yield eng


def test_chunked_prefill_matches_hf_alone_in_a_batch_and_joining_one(chunked, hf) -> None:
    long = PROMPTS[2] + " " + PROMPTS[1]
    alone = chunked.submit(long, greedy(12)).result(WAIT)
    assert alone.choices[0].token_ids == hf_greedy(hf, ids_of(chunked, long), 12)
    with chunked._lock:  # admitted together: chunks of several prompts share steps
        futures = [chunked.submit(p, greedy(20)) for p in [*PROMPTS, long]]
    started = threading.Event()
    running = chunked.submit(PROMPTS[0], greedy(30), on_token=lambda i, d: started.set())
    assert started.wait(WAIT)
    joining = [chunked.submit(p, greedy(10, n=n)) for p, n in ((long, 2), (PROMPTS[2], 1))]  # n rows share chunks
    for prompt, future, n in zip([*PROMPTS, long, PROMPTS[0], long, PROMPTS[2]], [*futures, running, *joining],
                                 [20] * 6 + [30, 10, 10], strict=True):
        result = future.result(WAIT)
        for choice in result.choices:
            assert choice.token_ids == hf_greedy(hf, ids_of(chunked, prompt), n), prompt
    stats = chunked.stats()
    assert stats["prefills"] > len(PROMPTS) + 4 and stats["tokens_in_flight"] == 0 and stats["running"] == 0
    assert 1 <= stats["prefill_budget_tokens"] <= 7  # the measured budget, never past the cap


def test_a_request_cancelled_during_its_chunked_prefill_stops_there(chunked) -> None:
    polls = []

    def is_cancelled() -> bool:  # polled once before every step, admission's included: true after three chunks
        polls.append(1)
        return len(polls) > 3

    long = " ".join([PROMPTS[2]] * 4)
    before = chunked.stats()
    result = chunked.submit(long, greedy(8), is_cancelled=is_cancelled).result(WAIT)
    after = chunked.stats()
    assert [(c.finish_reason, c.token_ids) for c in result.choices] == [("cancelled", [])]
    assert after["cancelled"] == before["cancelled"] + 1 and after["prefilling"] == 0
    prefilled = after["prompt_tokens"] - before["prompt_tokens"]
    assert after["tokens_in_flight"] == 0 and prefilled < len(ids_of(chunked, long))


@pytest.mark.parametrize("chunk", [0, 7])
def test_prefix_caching_reuses_shared_prefixes_and_output_is_unchanged(model_dir, hf, chunk) -> None:
    system = " ".join(PROMPTS[2:4] * 3)
    prompts = [system + " Hello there", system + " The quick brown", system + " Hello there"]
    with GenerationEngine(model_dir, device="cpu", precision="fp32", max_batch_size=8, prefill_chunk_tokens=chunk,
                          prefix_cache_bytes=1 << 20) as eng:
        results = [eng.submit(prompt, greedy(12)).result(WAIT) for prompt in prompts]
        with eng._lock:  # two sharing a cached prefix admitted together, one with two choices
            together = [eng.submit(prompts[1], greedy(8, n=2)), eng.submit(prompts[0], greedy(8))]
        results += [future.result(WAIT) for future in together]
    ids = [ids_of(eng, prompt) for prompt in prompts]
    shared = next(i for i, (a, b) in enumerate(zip(ids[0], ids[1], strict=False)) if a != b)
    assert [r.cached_tokens for r in results] == [0, shared // 16 * 16, len(ids[0]) // 16 * 16,
                                                  len(ids[1]) // 16 * 16, len(ids[0]) // 16 * 16]
    for result, prompt, n in zip(results, [*ids, ids[1], ids[0]], [12, 12, 12, 8, 8], strict=True):
        for choice in result.choices:
            assert choice.token_ids == hf_greedy(hf, prompt, n)


def tiny_cache() -> PagedCache:
    return PagedCache(n_layer=2, cache_heads=3, head_dim=8, device=torch.device("cpu"), dtype=torch.float32)


def filled(cache: PagedCache, rows: int, length: int) -> None:
    """Rows 0..rows-1 hold `length` positions of random keys and values."""
    for row in range(rows):
        cache.prepare(row, 0, length)
    cache.keys.normal_(), cache.values.normal_()


def test_the_prefix_cache_evicts_least_recently_used_blocks_later_ones_first() -> None:
    cache = tiny_cache()
    filled(cache, 2, 64)
    store = PrefixCache(3 * cache.block_bytes)
    a, b = Request("a", list(range(40)), greedy(), None, None, None), Request("b", [7] * 33, greedy(), None, None, None)
    store.remember(cache, a, 0)  # two blocks
    store.remember(cache, b, 1)  # two more: a's second block (its chain's end, least recently used) goes
    assert len(store.blocks) == 3 and block_keys(a.prompt, None)[1] not in store.blocks
    first = cache.tables[0][0]
    assert cache.refs[first] == 2 and cache.refs[cache.tables[0][1]] == 1  # evicted: held by its row alone
    again = Request("c", list(range(40)), greedy(), None, None, None)
    store.lookup(cache, again)
    assert again.cached_tokens == BLOCK and again.prefix == [first] and cache.refs[first] == 3
    store.restore(cache, again, 2)  # by reference: row 2 starts from row 0's first block, no copy
    assert cache.tables[2] == [first] and again.prefix == [] and cache.refs[first] == 3
    adapted = Request("d", list(range(40)), greedy(), None, None, None, adapter=AdapterUse("x"))
    store.lookup(cache, adapted)
    assert adapted.cached_tokens == 0  # another adapter: other keys
    for row in range(3):
        cache.free_row(row)
    assert cache.used_blocks == 3  # the store's
    moved = cache.compact()
    store.renumber(moved)
    assert sorted(store.blocks.values()) == [1, 2, 3] and cache.blocks == 4


@pytest.mark.parametrize("across_tenants", [False, True])
def test_a_tenants_cached_blocks_are_its_own_unless_shared_across_tenants(across_tenants) -> None:
    cache = tiny_cache()
    filled(cache, 1, 64)
    store = PrefixCache(8 * cache.block_bytes, across_tenants=across_tenants)
    store.remember(cache, Request("a", list(range(40)), greedy(), None, None, None, tenant="a"), 0)
    asks = {who: Request(who, list(range(40)), greedy(), None, None, None, tenant=tenant)
            for who, tenant in (("a again", "a"), ("b", "b"), ("no tenant", None))}
    for request in asks.values():
        store.lookup(cache, request)
    found = {who: request.cached_tokens for who, request in asks.items()}
    assert found == {"a again": 2 * BLOCK, "b": 2 * BLOCK if across_tenants else 0,
                     "no tenant": 2 * BLOCK if across_tenants else 0}


def test_requests_join_a_running_batch_and_reuse_its_rows(engine, hf) -> None:
    started, order = threading.Event(), []

    def slow(index: int, delta: str) -> None:  # keeps the first request running while others join
        started.set()
        time.sleep(0.01)

    first = engine.submit(PROMPTS[2], greedy(40), on_token=slow)
    first.add_done_callback(lambda f: order.append("first"))
    assert started.wait(WAIT)
    later = [engine.submit(p, greedy(n)) for p, n in ((PROMPTS[0], 8), (PROMPTS[1], 12), (PROMPTS[3], 5))]
    for future in later:
        future.add_done_callback(lambda f: order.append("later"))
    for prompt, future, n in zip([PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[3]], [first, *later], (40, 8, 12, 5),
                                 strict=True):
        assert future.result(WAIT).choices[0].token_ids == hf_greedy(hf, ids_of(engine, prompt), n)
    assert order[-1] == "first"  # the later ones joined mid-decode and finished first


def test_rows_are_reused_when_the_batch_is_full(model_dir, hf) -> None:
    with GenerationEngine(model_dir, device="cpu", precision="fp32", max_batch_size=2) as eng:
        futures = [eng.submit(p, greedy(6 + 3 * i)) for i, p in enumerate(PROMPTS)]
        for i, (prompt, future) in enumerate(zip(PROMPTS, futures, strict=True)):
            assert future.result(WAIT).choices[0].token_ids == hf_greedy(hf, ids_of(eng, prompt), 6 + 3 * i)
        assert eng.stats()["peak_running_sequences"] == 2


def test_repetition_penalty_matches_hf(engine, hf) -> None:
    result = engine.generate(PROMPTS[1], greedy(20, repetition_penalty=1.5))
    assert result.choices[0].token_ids == hf_greedy(hf, ids_of(engine, PROMPTS[1]), 20, repetition_penalty=1.5)


def test_seeded_sampling_is_the_same_alone_and_in_a_crowd(engine) -> None:
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=40, top_p=0.9, seed=1234)
    alone = engine.generate("Once upon a time", params)
    with engine._lock:
        crowd = [engine.submit(p, SamplingParams(max_new_tokens=10, temperature=1.2, repetition_penalty=1.3))
                 for p in PROMPTS[:3]]
        again = engine.submit("Once upon a time", params)
        crowd += [engine.submit(PROMPTS[3], greedy(20)), engine.submit(PROMPTS[1], SamplingParams(seed=5, top_p=0.5))]
    assert again.result(WAIT).choices == alone.choices
    assert all(isinstance(f.result(WAIT), GenerationResult) for f in crowd)


def test_n_choices_with_a_seed_are_distinct_and_reproducible(engine) -> None:
    params = SamplingParams(max_new_tokens=12, n=3, seed=7)
    first = engine.generate("It was a dark and stormy night", params)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.choices}) == 3
    assert engine.generate("It was a dark and stormy night", params).choices == first.choices
    single = engine.generate("It was a dark and stormy night", SamplingParams(max_new_tokens=12, seed=8))
    assert single.choices[0].token_ids == first.choices[1].token_ids  # choice i uses seed + i
    assert first.completion_tokens == 36


def test_stop_sequence_across_a_token_boundary_truncates_and_streams(engine) -> None:
    plain = engine.generate(PROMPTS[1], greedy(20)).choices[0]
    pieces = [engine.tokenizer.decode([t]) for t in plain.token_ids]
    boundary = len("".join(pieces[:3]))
    stop = plain.text[boundary - 1: boundary + 2]  # two characters of one token, one of the next
    expected = plain.text[: plain.text.find(stop)]
    deltas: list[tuple[int, str]] = []
    result = engine.generate(PROMPTS[1], greedy(20, stop=("never appears \u2603", stop)))
    streamed = engine.submit(PROMPTS[1], greedy(20, stop=(stop,)), on_token=lambda i, d: deltas.append((i, d)))
    for choice in (result.choices[0], streamed.result(WAIT).choices[0]):
        assert (choice.finish_reason, choice.text) == ("stop", expected)
    assert "".join(d for _, d in deltas) == expected and {i for i, _ in deltas} <= {0}
    assert all(stop not in d for _, d in deltas)


def test_max_new_tokens_ends_with_length_and_deltas_concatenate(engine) -> None:
    deltas: dict[int, list[str]] = {0: [], 1: []}
    result = engine.submit("Deltas", SamplingParams(max_new_tokens=9, n=2, seed=3),
                           on_token=lambda i, d: deltas[i].append(d)).result(WAIT)
    for choice in result.choices:
        assert choice.finish_reason == "length" and len(choice.token_ids) == 9
        assert "".join(deltas[choice.index]) == choice.text
        assert choice.text == engine.tokenizer.decode(choice.token_ids)
    assert result.completion_tokens == 18


def test_eos_ends_a_choice_and_a_folder_without_tokenizer_uses_the_bundled_one(engine, tmp_path) -> None:
    tokens = engine.generate(PROMPTS[1], greedy(12)).choices[0].token_ids
    stop_at = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    folder = build_tiny_gpt2(tmp_path / "eos", seed=0, eos_token_id=tokens[stop_at], tokenizer=False)
    with GenerationEngine(folder, device="cpu", precision="fp32") as eng:
        choice = eng.generate(PROMPTS[1], greedy(12)).choices[0]
    assert choice.finish_reason == "eos"
    assert choice.token_ids == tokens[: stop_at + 1]  # ends with the eos id ...
    assert choice.text == engine.tokenizer.decode(tokens[:stop_at])  # ... whose text is left out


def test_min_tokens_generates_past_the_eos_and_ignore_eos_runs_to_max_tokens(engine, tmp_path) -> None:
    tokens = engine.generate(PROMPTS[1], greedy(12)).choices[0].token_ids
    stop_at = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    eos = tokens[stop_at]
    folder = build_tiny_gpt2(tmp_path / "eos", seed=0, eos_token_id=eos, tokenizer=False)
    with GenerationEngine(folder, device="cpu", precision="fp32") as eng:
        held = eng.generate(PROMPTS[1], greedy(12, min_tokens=stop_at + 2)).choices[0]
        ignored = eng.generate(PROMPTS[1], greedy(12, ignore_eos=True)).choices[0]
    # a stop string in the first min_tokens tokens does not end the choice before them (vLLM's min_tokens)
    stop = engine.tokenizer.decode(tokens[:1])
    assert engine.generate(PROMPTS[1], greedy(12, stop=(stop,))).choices[0].token_ids == tokens[:1]
    stopped = engine.generate(PROMPTS[1], greedy(12, stop=(stop,), min_tokens=3)).choices[0]
    # below min_tokens the eos is masked (vLLM's min_tokens): the greedy choice is the next best token
    assert held.token_ids[:stop_at] == tokens[:stop_at] and held.token_ids[stop_at] != eos
    assert len(held.token_ids) >= stop_at + 2 and eos not in held.token_ids[:stop_at + 2]
    # ignore_eos: the eos is drawn and the choice goes on to max_tokens
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 12 and ignored.token_ids[stop_at] == eos
    assert ignored.token_ids[:stop_at] == tokens[:stop_at]
    assert len(stopped.token_ids) >= 3 and stopped.token_ids[:3] == tokens[:3] and stopped.text.startswith(stop)


def test_cancellation_frees_the_slot(narrow) -> None:
    cancel, deltas = threading.Event(), []

    def on_token(index: int, delta: str) -> None:
        deltas.append(delta)
        if len(deltas) == 3:
            cancel.set()

    running = narrow.submit("Cancel me", greedy(100), on_token=on_token, is_cancelled=cancel.is_set)
    waiting = narrow.submit("Next", greedy(5))
    choice = running.result(WAIT).choices[0]
    assert choice.finish_reason == "cancelled" and 3 <= len(choice.token_ids) < 100
    assert "".join(deltas) == choice.text
    assert waiting.result(WAIT).choices[0].finish_reason == "length"
    assert narrow.stats()["running"] == 0


def test_cancelled_ids_hook_drops_running_and_waiting_requests_within_one_step(model_dir: Path) -> None:
    flagged: set[str] = set()
    calls: list[list[str]] = []
    deltas: list[str] = []
    at_flag: list[int] = []

    def cancelled_ids(ids: list[str]) -> set[str]:
        calls.append(list(ids))
        return flagged & set(ids)

    def on_token(index: int, delta: str) -> None:
        deltas.append(delta)
        if len(deltas) == 2:
            # Tokens accepted so far: the counter is bumped after this step's callbacks, so +1 for this one.
            at_flag.append(eng.stats()["generated_tokens"] + 1)
            flagged.update({"running", "waiting"})  # takes effect before the next decode step

    with GenerationEngine(model_dir, device="cpu", max_batch_size=1, cancelled_ids=cancelled_ids) as eng:
        running = eng.submit("Cancel me", greedy(100), request_id="running", on_token=on_token)
        waiting = eng.submit("Never started", greedy(5), request_id="waiting")
        choice = running.result(WAIT).choices[0]
        assert choice.finish_reason == "cancelled" and len(choice.token_ids) == at_flag[0] < 100
        assert waiting.result(WAIT).choices[0].finish_reason == "cancelled"
        assert waiting.result().completion_tokens == 0
        stats = eng.stats()
    # One call per scheduler loop covering every request, not one per request.
    assert stats["steps"] <= len(calls) <= stats["steps"] + stats["prefills"] + 1
    assert any(set(c) == {"running", "waiting"} for c in calls)
    assert stats["running"] == 0 and stats["waiting"] == 0


def test_deadline_drops_a_waiting_request_before_the_model(narrow) -> None:
    gate = Gate()
    blocker = narrow.submit("Blocker", greedy(3), on_token=gate)
    assert gate.entered.wait(WAIT)
    before = narrow.stats()
    late = narrow.submit("Too late", greedy(3), deadline=time.monotonic() + 0.05)
    time.sleep(0.1)
    gate.opened.set()
    with pytest.raises(DeadlineExceeded):
        late.result(WAIT)
    blocker.result(WAIT)
    after = narrow.stats()
    assert (after["expired"], after["prefills"]) == (before["expired"] + 1, before["prefills"])
    with pytest.raises(DeadlineExceeded):
        narrow.submit("Already late", greedy(3), deadline=time.monotonic() - 1).result(WAIT)


def test_queue_full_is_raised_synchronously(narrow) -> None:
    gate = Gate()
    futures: list[Future] = [narrow.submit("Blocker", greedy(3), on_token=gate)]
    assert gate.entered.wait(WAIT)
    futures += [narrow.submit("one", greedy(3)), narrow.submit("two", greedy(3))]
    with pytest.raises(QueueFull, match="max_queue=2"):
        narrow.submit("three", greedy(3))
    gate.opened.set()
    assert all(f.result(WAIT).choices[0].finish_reason == "length" for f in futures)


def test_a_failing_callback_fails_only_its_request(engine) -> None:
    def broken(index: int, delta: str) -> None:
        raise RuntimeError("client went away")

    bad = engine.submit("Broken", greedy(8), on_token=broken)
    good = engine.submit("Fine", greedy(8))
    with pytest.raises(RuntimeError, match="client went away"):
        bad.result(WAIT)
    assert good.result(WAIT).choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([1] * 120, dict(max_new_tokens=16), r"\(120 tokens\) \+ max_new_tokens \(16\) = 136 exceeds .* 128"),
        ("", {}, "prompt is empty"),
        ([], {}, "prompt is empty"),
        ([50257], {}, r"integers in \[0, 50257\)"),
        ("x", dict(top_p=0), r"top_p must be in \(0, 1\]"),
        ("x", dict(temperature=-1), "temperature must be"),
        ("x", dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        ("x", dict(n=0), "n must be an integer >= 1"),
        ("x", dict(n=9), "n=9 exceeds max_batch_size=8"),
        ("x", dict(stop=("",)), "stop sequences must be non-empty"),
        ("x", dict(repetition_penalty=0), "repetition_penalty must be"),
    ],
)
def test_validation_errors(engine, prompt, params, match) -> None:
    with pytest.raises(ValueError, match=match):
        engine.submit(prompt, SamplingParams(**params))


def test_the_model_loads_on_the_scheduler_thread_and_a_load_error_raises_in_the_constructor(
        model_dir, tmp_path, monkeypatch) -> None:
    """The thread that steps the model is the one that loaded it: on a CPU a second thread's OpenMP team makes
    every parallel region of a decode step wait for a sleeping worker."""
    from worker.engines.generation import engine as engine_module

    loaded_on: list[str] = []
    open_runner = engine_module.open_runner

    def recorded(*args, **kwargs):
        loaded_on.append(threading.current_thread().name)
        return open_runner(*args, **kwargs)

    monkeypatch.setattr(engine_module, "open_runner", recorded)
    with GenerationEngine(model_dir, device="cpu", max_batch_size=1) as eng:
        assert eng.generate("Hello", greedy(2)).choices[0].token_ids
    assert loaded_on == ["generation-scheduler"]
    schedulers = sum(t.name == "generation-scheduler" for t in threading.enumerate())
    (tmp_path / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    with pytest.raises(ValueError, match="model_type 'bert' .* is not a causal language model"):
        GenerationEngine(tmp_path, device="cpu", max_batch_size=1)
    time.sleep(0.1)  # the failed load's thread has ended
    assert sum(t.name == "generation-scheduler" for t in threading.enumerate()) == schedulers


def test_close_fails_pending_requests(model_dir) -> None:
    eng = GenerationEngine(model_dir, device="cpu", max_batch_size=1)
    gate = Gate()
    running = eng.submit("Running", greedy(50), on_token=gate)
    assert gate.entered.wait(WAIT)
    waiting = eng.submit("Waiting", greedy(5))
    threading.Timer(0.2, gate.opened.set).start()
    eng.close()
    for future in (running, waiting):
        with pytest.raises(EngineClosed):
            future.result(WAIT)
    with pytest.raises(EngineClosed):
        eng.submit("After", greedy(5))


def test_packed_and_plain_decode_steps_agree(model_dir, engine) -> None:
    runner = Gpt2Runner(load_gpt2(model_dir, engine.plan), engine.plan, max_rows=8)  # its own weights and cache
    if runner.packed is None:
        pytest.skip("oneDNN packed weights are not available in this torch build")
    plain_runner = Gpt2Runner(load_gpt2(model_dir, engine.plan), engine.plan, max_rows=8, pack=False)
    positions = torch.tensor([3, 9, 1, 4, 7, 2])
    tokens = torch.tensor([464, 3290, 318, 11, 13, 262])
    with torch.inference_mode():
        outputs = []
        for each in (runner, plain_runner):
            torch.manual_seed(0)
            filled(each.cache, 6, 16)
            outputs.append(each.decode(tokens, positions, 10))
        packed, plain = outputs
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-5)
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))


def test_packed_weights_replace_the_originals(model_dir, engine, hf) -> None:
    # The weights are held once: the packed projections and LM head replace the mapped originals.
    if engine._runner.packed is None:
        pytest.skip("oneDNN packed weights are not available in this torch build")
    size = sum(p.numel() * p.element_size() for p in hf.parameters())  # tied embedding counted once
    wte = hf.transformer.wte.weight
    # A tied embedding also stays for row lookups (mapped from the checkpoint, only looked-up rows resident).
    tied = wte.numel() * wte.element_size() if hf.lm_head.weight is wte else 0
    assert engine.weight_bytes == size + tied
    held = engine._runner.tensors
    assert not [name for name in held if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))]
    assert "lm_head.weight" not in held


def test_a_decode_step_and_a_prefill_in_one_pass_equal_both_apart(model_dir, engine) -> None:
    # The engine prefills newly admitted prompts inside the running rows' decode step (one weight read).
    together = Gpt2Runner(load_gpt2(model_dir, engine.plan), engine.plan, max_rows=8)
    apart = Gpt2Runner(load_gpt2(model_dir, engine.plan), engine.plan, max_rows=8)
    tokens, positions = torch.tensor([464, 3290, 318]), torch.tensor([3, 9, 1])
    prompts, rows = [[11, 12, 13, 14], [15, 16]], [[3, 4], [5]]
    with torch.inference_mode():
        for each in (together, apart):
            torch.manual_seed(0)
            filled(each.cache, 6, 16)
        both = together.forward(DecodeInput(tokens, positions, 10), PrefillInput(prompts, rows, [0, 0]))
        step, first = apart.decode(tokens, positions, 10), apart.prefill(prompts, rows)
    torch.testing.assert_close(both, torch.cat([step, first]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(together.cache.keys, apart.cache.keys, rtol=1e-4, atol=1e-5)  # same cache writes
    torch.testing.assert_close(together.cache.values, apart.cache.values, rtol=1e-4, atol=1e-5)
