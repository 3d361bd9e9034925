"""Decode steps replayed as CUDA graphs (serving/runners/cuda_graphs.py) equal the eager paths on CUDA, fp32."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_llama import build_tiny_decoder
from tests.tiny_lm import build_tiny_gpt2
from tests.unit.test_engine_cuda_graphs import arrive_mid_run
from worker.engines.generation.engine import GenerationEngine, SamplingParams

pytestmark = pytest.mark.gpu
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog and", "A",
           "To be, or not to be: that is the question.", "First Citizen: hear me speak."]
# Greedy, plain and top-k / top-p draws and a penalty, all inside the graph (no top-p without top-k: its
# nucleus may reach past the candidates, and then the draw is eager; the CPU tests cover that).
PARAMS = [SamplingParams(max_new_tokens=24, temperature=0),
          SamplingParams(max_new_tokens=10, temperature=0.9, seed=1, n=2),
          SamplingParams(max_new_tokens=17, temperature=0, repetition_penalty=1.4, logprobs=2),
          SamplingParams(max_new_tokens=5, temperature=1.1, seed=4, repetition_penalty=1.2, top_k=30, top_p=0.8),
          SamplingParams(max_new_tokens=20, temperature=0)]
WAIT = 120


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "gpt2":
        return build_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2-graphs"), seed=0)
    folder = tmp_path_factory.mktemp("tiny-llama-graphs") / "llama"
    build_tiny_decoder("llama", folder)
    return folder


def _run(folder: Path, mode: str) -> tuple[list[list[list[int]]], list, int, int]:
    with GenerationEngine(folder, device="cuda", precision="fp32", max_batch_size=8, decode_graphs=mode) as engine:
        with engine._lock:  # one batch of 6 rows (padded to 8), rows finishing at different steps
            futures = [engine.submit(p, params) for p, params in zip(PROMPTS, PARAMS, strict=True)]
        results = [f.result(WAIT) for f in futures]
        static = engine._loop.static
        steps, captures = (static.steps, static.captures) if static is not None else (0, 0)
        assert static is None or static.eager_draws == 0
    tokens = [[c.token_ids for c in r.choices] for r in results]
    logprobs = [[e.logprob for e in r.choices[0].logprobs or []] for r in results]
    return tokens, logprobs, steps, captures


def test_graph_replay_equals_the_eager_paths(model_dir: Path) -> None:
    tokens, logprobs, steps, captures = _run(model_dir, "cuda")
    assert steps >= 23 and captures >= 3  # buckets 8, 4 (and smaller) as rows finish
    uncaptured, uncaptured_logprobs, eager_steps, no_captures = _run(model_dir, "eager")
    assert eager_steps == steps and no_captures == 0
    assert tokens == uncaptured  # the same padded step, replayed vs run op by op
    assert logprobs[2] == pytest.approx(uncaptured_logprobs[2], abs=1e-5)
    ordinary, ordinary_logprobs, _, _ = _run(model_dir, "off")
    assert tokens == ordinary  # and the ordinary decode (span-wide attention, next_tokens)
    assert logprobs[2] == pytest.approx(ordinary_logprobs[2], abs=1e-4)


def test_graphs_are_captured_again_when_the_cache_grows(model_dir: Path) -> None:
    outputs = {}
    for mode in ("off", "cuda"):
        with GenerationEngine(model_dir, device="cuda", precision="fp32", max_batch_size=4,
                              decode_graphs=mode) as engine:
            results, _ = arrive_mid_run(engine, PROMPTS[3], WAIT)
            outputs[mode] = [r.choices[0].token_ids for r in results]
            if mode == "cuda":
                assert engine._loop.static is not None and engine._loop.static.captures >= 2
    assert outputs["cuda"] == outputs["off"]
