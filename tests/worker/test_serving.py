"""The generation worker's engine registry with tiny real GPT-2s: LRU eviction under a budget (weights and the
prefix cache an idle engine keeps), per-model loads, and the metrics read from the warm engines."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from core.protocol import SamplingParams
from tests.tiny_lm import build_tiny_gpt2
from worker.engines.generation.engine import GenerationEngine
from worker.metrics import EngineState
from worker.servers.generation import EngineRegistry, _footprint

WAIT = 60


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("registry")
    return {name: build_tiny_gpt2(root / name, seed=seed, n_positions=32) for seed, name in enumerate("abc")}


def _engine(path: str) -> GenerationEngine:
    return GenerationEngine(path, device="cpu", max_batch_size=2)


def _say(engine: GenerationEngine) -> str:
    return engine.generate("Hello", SamplingParams(max_new_tokens=3, temperature=0)).choices[0].text


def test_least_recently_used_idle_engines_are_evicted_under_the_budget(models) -> None:
    probe = _engine(str(models["a"]))
    size = _footprint(probe)
    probe.close()
    registry = EngineRegistry(_engine, budget_bytes=int(size * 2.5), footprint=_footprint)  # room for two
    try:
        with registry.use(str(models["a"])) as a:
            first = _say(a)
        with registry.use(str(models["b"])):
            pass
        with registry.use(str(models["a"])) as again:  # a is now the most recently used
            assert again is a and _say(again) == first
        with registry.use(str(models["c"])):
            pass
        assert registry.loaded() == [str(models["a"]), str(models["c"])]  # b was the least recently used
        assert a.stats()["closed"] is False and registry.used_bytes() <= registry.budget_bytes

        # An engine in use is never evicted, even over budget; it goes once idle and something else is loaded.
        with registry.use(str(models["a"])) as busy, registry.use(str(models["b"])), registry.use(str(models["c"])):
            assert len(registry.loaded()) == 3 and _say(busy) == first
        assert len(registry.loaded()) == 2 and registry.used_bytes() <= registry.budget_bytes
    finally:
        registry.close()


def test_a_loading_model_does_not_block_requests_for_loaded_ones(models) -> None:
    slow_started, slow_go = threading.Event(), threading.Event()
    builds: list[str] = []

    def build(path: str) -> GenerationEngine:
        builds.append(path)
        if path == str(models["b"]):
            slow_started.set()
            assert slow_go.wait(WAIT)
        return _engine(path)

    registry = EngineRegistry(build, budget_bytes=10**12, footprint=_footprint)
    try:
        with registry.use(str(models["a"])):
            pass
        results: list[str] = []

        def use_b() -> None:
            with registry.use(str(models["b"])) as engine:
                results.append(_say(engine))

        loaders = [threading.Thread(target=use_b) for _ in range(2)]
        for thread in loaders:
            thread.start()
        assert slow_started.wait(WAIT)
        started = time.monotonic()
        with registry.use(str(models["a"])) as a:  # served while b is still loading
            _say(a)
        assert time.monotonic() - started < 10 and not results
        slow_go.set()
        for thread in loaders:
            thread.join(WAIT)
        assert len(results) == 2 and results[0] == results[1]
        assert builds.count(str(models["b"])) == 1  # two waiting callers, one load
    finally:
        slow_go.set()
        registry.close()


def test_an_engine_counts_its_prefix_cache_budget_in_its_footprint(models) -> None:
    """An idle engine keeps its prefix cache's blocks, so the registry's budget counts them with the weights."""
    plain, caching = _engine(str(models["a"])), GenerationEngine(str(models["a"]), device="cpu", max_batch_size=2,
                                                                 prefix_cache_bytes=4 * 2**20)
    try:
        assert _footprint(caching) == _footprint(plain) + 4 * 2**20
    finally:
        plain.close()
        caching.close()


def test_the_worker_metrics_read_the_warm_engines_at_each_scrape(models) -> None:
    """KV cache bytes, cached prompt tokens and draft tokens per model, from the engines' own counts."""
    state = EngineState()
    scraped = CollectorRegistry()
    scraped.register(state)
    empty = {family.name for family in text_string_to_metric_families(generate_latest(scraped).decode())}
    assert "trainserve_generation_kv_cache_bytes" in empty  # described with no engine warm yet
    prompt = list(range(1, 9)) * 2 + [1, 2]  # a full block, cached after the first request; a repeating input
    with GenerationEngine(str(models["a"]), device="cpu", max_batch_size=2, prefix_cache_bytes=2**20,
                          speculative_tokens=4) as engine:
        state.source = lambda: [("a", engine.stats())]
        for _ in range(2):
            engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0))
        stats = engine.stats()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(generate_latest(scraped).decode())
                   for s in family.samples}
    model = (("model", "a"),)
    block = stats["cache_block_bytes"]
    assert samples[("trainserve_generation_kv_cache_bytes", (("model", "a"), ("part", "prefix")))] == \
        stats["prefix_cache_blocks"] * block > 0
    assert samples[("trainserve_generation_kv_cache_bytes", (("model", "a"), ("part", "pool")))] == \
        stats["cache_blocks"] * block
    assert samples[("trainserve_generation_prompt_tokens_cached_total", model)] == stats["cached_prompt_tokens"] > 0
    assert samples[("trainserve_generation_draft_tokens_total", model)] == stats["draft_tokens"]
    assert samples[("trainserve_generation_draft_tokens_accepted_total", model)] == stats["accepted_draft_tokens"]
    assert samples[("trainserve_generation_sequences_running", model)] == 0
    assert samples[("trainserve_generation_requests_waiting", model)] == 0


def test_an_engine_that_stopped_serving_is_loaded_again(models) -> None:
    """An engine that is no longer alive (a vLLM server whose engine core died) is replaced on its next use, once no
    request holds it; one in use is left to its requests."""
    registry = EngineRegistry(_engine, budget_bytes=10**12, footprint=_footprint, alive=lambda e: e.alive())
    try:
        with registry.use(str(models["a"])) as first:
            first.close()  # stands in for a server that died
            with registry.use(str(models["a"])) as held:
                assert held is first  # in use: not replaced under its requests
        assert not first.alive()
        with registry.use(str(models["a"])) as again:
            assert again is not first and again.alive() and _say(again)
        assert registry.loaded() == [str(models["a"])]
    finally:
        registry.close()
