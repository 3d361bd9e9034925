"""The static-shape decode step (serving/runners/cuda_graphs.py) run uncaptured on the CPU: bucket choice, padding,
and output equal to the ordinary decode path token for token (GPT-2 and a llama-family decoder, fp32)."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from core.protocol import Constraint
from tests.tiny_adapters import make_adapters
from tests.tiny_llama import build_tiny_decoder
from tests.tiny_lm import build_tiny_gpt2
from worker.engines.device import resolve_device
from worker.engines.generation.caches.paged_cache import blocks_for
from worker.engines.generation.engine import GenerationEngine, SamplingParams
from worker.engines.generation.runners import cuda_graphs
from worker.engines.generation.runners.cuda_graphs import (
    StaticDecoder,
    StaticInputs,
    bucket_for,
    buckets,
    static_decoder,
)
from worker.engines.generation.runners.gpt2 import Gpt2Runner
from worker.engines.generation.runners.gpt2_weights import load_gpt2
from worker.engines.generation.sampling.sampler import RowParams

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog and",
    "To be, or not to be: that is the question. Whether 'tis nobler in the mind",
    "A",
    "First Citizen: before we proceed any further, hear me speak.",
]
WAIT = 60
GREEDY = SimpleNamespace(params=SamplingParams(temperature=0))  # a row's request, as the static step reads it


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2-static"), seed=0)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama-static") / "llama"
    build_tiny_decoder("llama", folder)
    return folder


def test_buckets_are_powers_of_two_then_max_rows() -> None:
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(33) == [1, 2, 4, 8, 16, 32, 33]
    assert [bucket_for(n, buckets(6)) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert bucket_for(3, buckets(32)) == 4
    with pytest.raises(ValueError):
        bucket_for(7, buckets(6))
    with pytest.raises(ValueError):
        buckets(0)


def test_inputs_pad_with_greedy_rows_at_position_zero() -> None:
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.5, seed=7),
              SamplingParams(temperature=0, repetition_penalty=1.3)]
    rows = RowParams(params, torch.device("cpu"), seeds=[None, 7, None], counters=[0, 5, 2])
    inputs = StaticInputs.empty(4, torch.device("cpu"))
    inputs.fill([11, 12, 13], [3, 9, 4], rows)
    assert inputs.tokens.tolist() == [11, 12, 13, 0]
    assert inputs.positions.tolist() == [3, 9, 4, 0]
    assert inputs.sampled.tolist() == [False, True, False, False]
    assert inputs.temperature[:, 0].tolist() == [1.0, 0.5, 1.0, 1.0]
    assert inputs.seeds.tolist() == [0, 7, 0, 0] and inputs.counters.tolist() == [0, 5, 0, 0]
    assert inputs.penalty[:, 0].tolist() == pytest.approx([1.0, 1.0, 1.3, 1.0])
    assert not inputs.truncated.any() and inputs.top_k.tolist() == [0] * 4 and inputs.top_p.tolist() == [1.0] * 4
    # top-k / top-p rows: RowParams lists them among the sampled rows; the inputs by batch row.
    mixed = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0),
             SamplingParams(temperature=0.9, top_k=20, seed=2), SamplingParams(temperature=1.0, top_p=0.8, seed=3)]
    inputs.fill([1, 2, 3, 4], [1, 1, 1, 1], RowParams(mixed, torch.device("cpu")))
    assert inputs.sampled.tolist() == [True, False, True, True]
    assert inputs.truncated.tolist() == [False, False, True, True]
    assert inputs.top_k.tolist() == [0, 0, 20, 0] and inputs.top_p.tolist() == pytest.approx([1, 1, 1, 0.8])
    # A smaller batch later in the same buffers: what the larger one left is cleared.
    inputs.fill([21], [1], RowParams(params[:1], torch.device("cpu")))
    assert inputs.tokens.tolist() == [21, 0, 0, 0] and not inputs.sampled.any() and not inputs.truncated.any()
    assert inputs.penalty[:, 0].tolist() == [1.0] * 4 and inputs.top_p.tolist() == [1.0] * 4


def test_mode_names() -> None:
    runner = SimpleNamespace(device=torch.device("cpu"), max_rows=4)
    seen = torch.zeros(4, 8, dtype=torch.bool)
    assert static_decoder("off", runner, seen) is None
    assert static_decoder("cuda", runner, seen) is None  # no graphs on a CPU device: the ordinary path
    decoder = static_decoder("eager", runner, seen)
    assert isinstance(decoder, StaticDecoder) and not decoder.capture
    with pytest.raises(ValueError):
        static_decoder("on", runner, seen)


def test_padded_step_equals_the_ordinary_decode_across_a_wider_table(gpt2_dir: Path) -> None:
    plan = resolve_device("cpu", "fp32", generation=True)
    runner = Gpt2Runner(load_gpt2(gpt2_dir, plan), plan, max_rows=8)
    prompts = [[464, 3290, 318], [15496, 11], [40, 1842, 257, 3797, 13]]  # 3 rows: padded to a bucket of 4
    with torch.inference_mode():
        runner.prefill(prompts, [[i] for i in range(len(prompts))])
        decoder = StaticDecoder(runner, torch.zeros(8, runner.config.vocab_size, dtype=torch.bool), capture=False)
        greedy = RowParams([SamplingParams(temperature=0)] * 3, runner.device)
        rows = [SimpleNamespace(tokens=[p[-1]], position=len(p), matcher=None, request=GREEDY) for p in prompts]
        for _ in range(14):  # positions reach 18: the rows' tables go from one block to two mid-run
            positions = [r.position for r in rows]
            expected = runner.decode(torch.tensor([r.tokens[-1] for r in rows]), torch.tensor(positions),
                                     max(positions) + 1)
            got, tokens = decoder.step(rows, greedy)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            assert tokens.tolist() == expected.argmax(dim=-1).tolist()
            for row, token in zip(rows, tokens.tolist(), strict=True):
                row.tokens.append(token)
                row.position += 1
    assert set(decoder.tables) == {(4, 1), (4, 2)} and decoder.steps == 14
    assert runner.cache.tables[3] == []  # the padding row's block went back after each step


def _generate(folder: Path, mode: str, params: list[SamplingParams], *, max_batch_size: int = 8):
    """Results, and the static steps run and how many of them drew eagerly (0, 0 with the mode off)."""
    with GenerationEngine(folder, device="cpu", precision="fp32", max_batch_size=max_batch_size,
                          decode_graphs=mode) as engine:
        with engine._lock:  # admitted together: one batch whose rows finish at different steps
            futures = [engine.submit(prompt, p) for prompt, p in zip(PROMPTS, params, strict=True)]
        results = [f.result(WAIT) for f in futures]
        static = engine._loop.static
        steps = (static.steps, static.eager_draws) if static is not None else (0, 0)
    return results, steps


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_greedy_with_the_padded_step_equals_the_ordinary_path(request, model) -> None:
    folder = request.getfixturevalue(f"{model}_dir")
    params = [SamplingParams(max_new_tokens=n, temperature=0) for n in (20, 7, 13, 3, 16)]  # 5 rows, then fewer
    eager, _ = _generate(folder, "off", params)
    padded, (steps, eager_draws) = _generate(folder, "eager", params)
    assert steps >= 19 and eager_draws == 0  # every decode step after the prefill went through the padded path
    assert [r.choices[0].token_ids for r in padded] == [r.choices[0].token_ids for r in eager]
    assert [len(r.choices[0].token_ids) for r in padded] == [20, 7, 13, 3, 16]


def test_seeded_sampling_penalty_and_logprobs_equal_the_ordinary_path(gpt2_dir: Path) -> None:
    params = [SamplingParams(max_new_tokens=12, temperature=0.9, seed=1, n=2),
              SamplingParams(max_new_tokens=9, temperature=0, repetition_penalty=1.5, logprobs=3),
              SamplingParams(max_new_tokens=10, temperature=1.2, seed=5, repetition_penalty=1.2, logprobs=0),
              SamplingParams(max_new_tokens=4, temperature=0),
              SamplingParams(max_new_tokens=11, temperature=0.7, seed=9)]
    eager, _ = _generate(gpt2_dir, "off", params)
    padded, (steps, eager_draws) = _generate(gpt2_dir, "eager", params)
    assert steps >= 11 and eager_draws == 0
    for mine, theirs in zip(padded, eager, strict=True):
        assert [c.token_ids for c in mine.choices] == [c.token_ids for c in theirs.choices]
        for a, b in zip(mine.choices, theirs.choices, strict=True):
            if b.logprobs is not None:
                assert a.logprobs is not None
                assert [e.token for e in a.logprobs] == [e.token for e in b.logprobs]
                assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-5)


@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("top_p", [None, 0.9, 0.3])
def test_top_k_and_top_p_draws_equal_the_ordinary_path(request, model, top_p) -> None:
    # Top-k rows (with or without top-p) draw in the graph. A top-p row without top-k may need more than the 256
    # candidates: the tiny GPT-2's random head is almost flat over 50,257 tokens, so a 0.9 or 0.3 nucleus holds
    # thousands and those steps redraw eagerly; the tiny Llama's 0.3 nucleus fits in the candidates.
    folder = request.getfixturevalue(f"{model}_dir")
    params = [SamplingParams(max_new_tokens=8, temperature=0.8, top_k=40, seed=3, n=2),
              SamplingParams(max_new_tokens=10, temperature=1.0, top_p=top_p or 1.0, seed=4),
              SamplingParams(max_new_tokens=6, temperature=0.7, top_k=10, top_p=0.5, seed=5),
              SamplingParams(max_new_tokens=9, temperature=0),
              SamplingParams(max_new_tokens=7, temperature=1.3, seed=6, repetition_penalty=1.3)]
    eager, _ = _generate(folder, "off", params)
    padded, (steps, eager_draws) = _generate(folder, "eager", params)
    assert steps >= 9
    in_graph = top_p is None or (model, top_p) == ("llama", 0.3)
    assert (eager_draws == 0) if in_graph else (eager_draws > 0)
    assert [[c.token_ids for c in r.choices] for r in padded] == [[c.token_ids for c in r.choices] for r in eager]


def test_grammar_and_large_top_k_rows_draw_eagerly_on_the_graph_logits(gpt2_dir: Path) -> None:
    params = [SamplingParams(max_new_tokens=12, temperature=0, constraint=Constraint(kind="regex", spec="[0-9]+")),
              SamplingParams(max_new_tokens=6, temperature=0.8, top_k=300, seed=2),
              SamplingParams(max_new_tokens=12, temperature=0),
              SamplingParams(max_new_tokens=3, temperature=0),
              SamplingParams(max_new_tokens=12, temperature=0.9, seed=8)]
    eager, _ = _generate(gpt2_dir, "off", params)
    padded, (steps, eager_draws) = _generate(gpt2_dir, "eager", params)
    assert steps >= 11 and eager_draws == steps  # the grammar row is there until the end
    assert [r.choices[0].token_ids for r in padded] == [r.choices[0].token_ids for r in eager]
    assert padded[0].choices[0].text.isdigit()


def test_rows_short_of_min_tokens_draw_eagerly_with_the_eos_masked(gpt2_dir: Path) -> None:
    params = [SamplingParams(max_new_tokens=12, temperature=0, min_tokens=5),
              SamplingParams(max_new_tokens=10, temperature=0.9, seed=2, min_tokens=10, ignore_eos=True),
              SamplingParams(max_new_tokens=12, temperature=0),
              SamplingParams(max_new_tokens=3, temperature=0),
              SamplingParams(max_new_tokens=12, temperature=0.9, seed=8)]
    eager, _ = _generate(gpt2_dir, "off", params)
    padded, (steps, eager_draws) = _generate(gpt2_dir, "eager", params)
    assert steps >= 11 and 0 < eager_draws < steps  # eagerly until the second row holds its 10 tokens
    assert [r.choices[0].token_ids for r in padded] == [r.choices[0].token_ids for r in eager]


def arrive_mid_run(engine: GenerationEngine, prompt: str, wait: float) -> tuple[list, int]:
    """"Hello" for 40 greedy tokens, then `prompt` for 90 once the first streams: both results, and the cache pool's
    blocks when the second arrived (the GPU test runs the same scenario)."""
    started = threading.Event()
    first = engine.submit("Hello", SamplingParams(max_new_tokens=40, temperature=0),
                          on_token=lambda *_: started.set())
    assert started.wait(wait)
    before = engine.stats()["cache_blocks"]
    second = engine.submit(prompt, SamplingParams(max_new_tokens=90, temperature=0))
    return [first.result(wait), second.result(wait)], before


def test_a_request_arriving_mid_run_grows_the_cache_under_the_padded_step(gpt2_dir: Path) -> None:
    outputs = {}
    for mode in ("off", "eager"):
        with GenerationEngine(gpt2_dir, device="cpu", precision="fp32", max_batch_size=4,
                              decode_graphs=mode) as engine:
            results, before = arrive_mid_run(engine, PROMPTS[2], WAIT)
        # The pool held what "Hello" had taken; the second request's blocks do not fit in it: the pool grew.
        needed = sum(blocks_for(r.prompt_tokens + len(r.choices[0].token_ids)) for r in results)
        assert needed > before - 1
        outputs[mode] = [r.choices[0].token_ids for r in results]
    assert outputs["eager"] == outputs["off"]


def test_adapter_rows_step_eagerly_and_the_base_rows_alone_go_static(llama_dir: Path, tmp_path: Path) -> None:
    folders = make_adapters(llama_dir, tmp_path)
    outputs, static_steps = {}, {}
    for mode in ("off", "eager"):
        with GenerationEngine(llama_dir, device="cpu", precision="fp32", max_batch_size=4, max_loras=2,
                                  adapter_folder=lambda name: folders[name], decode_graphs=mode) as engine:
            with engine._lock:  # one batch: a base row that outlives an adapter row
                futures = [engine.submit(PROMPTS[1], SamplingParams(max_new_tokens=16, temperature=0)),
                           engine.submit(PROMPTS[2], SamplingParams(max_new_tokens=5, temperature=0),
                                         adapter="wide")]
            outputs[mode] = [f.result(WAIT).choices[0].token_ids for f in futures]
            static_steps[mode] = engine._loop.static.steps if engine._loop.static is not None else 0
    assert outputs["eager"] == outputs["off"]
    assert [len(tokens) for tokens in outputs["eager"]] == [16, 5]
    assert static_steps["eager"] == 11  # 15 decode steps: the 4 with the adapter's row ran the ordinary path


def test_a_failed_capture_runs_the_step_uncaptured_and_turns_graphs_off(gpt2_dir: Path, monkeypatch) -> None:
    def refuse(run, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "_Graph", refuse)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # no GPU to select here
    plan = resolve_device("cpu", "fp32", generation=True)
    runner = Gpt2Runner(load_gpt2(gpt2_dir, plan), plan, max_rows=4)
    with torch.inference_mode():
        runner.prefill([[464, 3290], [15496]], [[0], [1]])
        decoder = StaticDecoder(runner, torch.zeros(4, runner.config.vocab_size, dtype=torch.bool), capture=False)
        decoder.capture = True  # as on a GPU, with a capture that fails
        rows = [SimpleNamespace(tokens=[3290], position=2, matcher=None, request=GREEDY),
                SimpleNamespace(tokens=[15496], position=1, matcher=None, request=GREEDY)]
        expected = runner.decode(torch.tensor([3290, 15496]), torch.tensor([2, 1]), 3)
        logits, tokens = decoder.step(rows, RowParams([SamplingParams(temperature=0)] * 2, runner.device))
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert tokens.tolist() == expected.argmax(dim=-1).tolist()
    assert decoder.failed is not None and "capturing" in decoder.failed and decoder.captures == 0
