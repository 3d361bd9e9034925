"""A static-shape decode step, replayed as a captured CUDA graph per batch-size bucket (as vLLM does).

A decode step's shapes normally depend on the batch (B rows) and on how far the longest row has got (its
attention reads positions < max(positions) + 1). The static step fixes both: the batch is padded up to a bucket
(1, 2, 4, ... up to max_rows), the padding rows take spare cache rows (token 0 at position 0, outputs dropped),
and attention reads the cache's whole position capacity with the mask built from a positions tensor. Its inputs
are static buffers (tokens, positions, and the sampler's per-row settings), so the forward, the repetition
penalty, greedy argmax and the counter-based draw (sampling.counter_uniforms: no generator state) run as one
graph per (bucket, cache capacity): warmed up on a side stream, captured into one memory pool shared by all
captures, replayed each step, captured again when the cache grows (new tensors, new addresses).

What stays eager (the whole step runs the ordinary path): steps with prefill chunks or a prompt part-way
through its prefill (its rows sit where the padding would go), rows of LoRA adapters, grammar-constrained rows
(their masks are built on the host per step) and top-k / top-p rows (their candidate search reads the device).
Logprobs are taken after the replay from the graph's logits output (record_logprobs: the top-k size varies per
request). A capture that fails (an op that cannot be captured) is logged, that step runs uncaptured and the
engine steps on the ordinary path from then on. On a CPU ("eager" mode) the same padded step runs without
capture: that is what the CPU tests check.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from worker.engines.batch import SequenceState
from worker.engines.sampling import RowParams, _inverse_cdf, counter_uniforms, penalize

MODES = ("off", "cuda", "eager")
log = logging.getLogger(__name__)


def buckets(max_rows: int) -> list[int]:
    """The batch sizes steps are padded to: powers of two below max_rows, then max_rows itself."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be positive, got {max_rows}")
    sizes = [1]
    while sizes[-1] * 2 < max_rows:
        sizes.append(sizes[-1] * 2)
    return sizes if sizes[-1] == max_rows else [*sizes, max_rows]


def bucket_for(rows: int, sizes: Sequence[int]) -> int:
    """The smallest bucket that holds `rows` rows (ValueError past the largest)."""
    for size in sizes:
        if size >= rows:
            return size
    raise ValueError(f"{rows} rows exceed the largest bucket ({sizes[-1]})")


def static_eligible(rows: Sequence[SequenceState], params: RowParams) -> bool:
    """Whether a decode step of these rows can run the static step (see the module docstring for what cannot)."""
    return params.truncated is None and all(s.matcher is None and s.request.adapter is None for s in rows)


@dataclass
class StaticInputs:
    """The padded step's input buffers [bucket] (their addresses are what a graph reads)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    temperature: torch.Tensor  # [bucket, 1]; 1 for greedy and padding rows
    seeds: torch.Tensor
    counters: torch.Tensor
    sampled: torch.Tensor  # bool: the row draws (else argmax)
    penalty: torch.Tensor  # [bucket, 1]; 1 where off (x * 1 and x / 1 are exact)

    @classmethod
    def empty(cls, bucket: int, device: torch.device) -> StaticInputs:
        longs = [torch.zeros(bucket, dtype=torch.long, device=device) for _ in range(4)]
        ones = [torch.ones(bucket, 1, device=device) for _ in range(2)]
        return cls(longs[0], longs[1], ones[0], longs[2], longs[3],
                   torch.zeros(bucket, dtype=torch.bool, device=device), ones[1])

    def fill(self, tokens: list[int], positions: list[int], params: RowParams) -> None:
        """Copy one step's rows in (padding rows: token 0 at position 0, greedy, no penalty)."""
        n, device = len(tokens), self.tokens.device
        self.tokens.zero_()
        self.tokens[:n].copy_(torch.tensor(tokens, dtype=torch.long))
        self.positions.zero_()
        self.positions[:n].copy_(torch.tensor(positions, dtype=torch.long))
        index = params.sample_index.to(device)
        self.temperature.fill_(1.0)
        self.temperature.index_copy_(0, index, params.temperature.to(self.temperature.dtype))
        self.seeds.zero_()
        self.seeds.index_copy_(0, index, params.seeds)
        self.counters.zero_()
        self.counters.index_copy_(0, index, params.counters)
        self.sampled.zero_()
        self.sampled.index_fill_(0, index, True)
        self.penalty.fill_(1.0)
        if params.penalty is not None:
            self.penalty[:n].copy_(params.penalty)


def sample_static(logits: torch.Tensor, inputs: StaticInputs, seen: torch.Tensor) -> torch.Tensor:
    """next_tokens for every padded row at once, without host reads: penalty, then argmax or a plain draw.

    Row for row the same operations as sampling.next_tokens on its plain (no top-k / top-p) rows.
    """
    logits = penalize(logits, seen, inputs.penalty)
    greedy = logits.argmax(dim=-1)
    probs = (logits / inputs.temperature).softmax(dim=-1)
    drawn = _inverse_cdf(probs, counter_uniforms(inputs.seeds, inputs.counters))
    return torch.where(inputs.sampled, drawn, greedy)


class _Graph:
    """One bucket's captured step: replay() reruns it on whatever its inputs hold now."""

    def __init__(self, run: Any, pool: Any) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture: lazy inits, cuBLAS workspaces, autotuning
            for _ in range(2):
                run()  # writes the same keys/values at the same slots as the replay will: harmless
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the scheduler threads of other engines in this worker keep using CUDA meanwhile
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.outputs = run()

    def replay(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.graph.replay()
        return self.outputs


class StaticDecoder:
    """The padded decode step over a runner's cache; captured as CUDA graphs when `capture`, else run eagerly."""

    def __init__(self, runner: Any, seen: torch.Tensor, *, capture: bool) -> None:
        self.runner = runner
        self.seen = seen  # the engine's [max_rows, V] tokens-seen mask (a persistent tensor: graphs read it)
        self.capture = capture
        self.sizes = buckets(runner.max_rows)
        self.inputs: dict[int, StaticInputs] = {}
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.captures = 0  # graphs captured so far (a new cache means new ones)
        self.steps = 0  # steps run here (replayed or, uncaptured, run)
        self.failed: str | None = None  # why a capture failed: the engine then steps on the ordinary path
        self._cache: tuple[int, int] | None = None  # the cache tensors' addresses the graphs were captured on
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def step(self, rows: Sequence[SequenceState], params: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode one step for rows 0..len(rows)-1: (logits [len(rows), V], next tokens [len(rows)])."""
        n = len(rows)
        bucket = bucket_for(n, self.sizes)
        self.runner.reserve(bucket, 1)  # spare rows for the padding (the cache grows by doubling: rarely needed)
        inputs = self.inputs.get(bucket)
        if inputs is None:
            inputs = self.inputs[bucket] = StaticInputs.empty(bucket, self.runner.device)
        inputs.fill([s.tokens[-1] for s in rows], [s.position for s in rows], params)
        graph = self._graph(bucket, inputs) if self.capture else None
        logits, tokens = graph.replay() if graph is not None else self._run(bucket, inputs)
        self.steps += 1
        if params.sample_rows:
            params.counters += 1  # as next_tokens does: each sampled row has drawn one more token
        return logits[:n], tokens[:n]

    def _run(self, bucket: int, inputs: StaticInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The step itself: the runner's decode over the whole position capacity, then sample_static."""
        span = self.runner.capacity[1]
        lora = getattr(self.runner, "lora", None)
        if lora is not None:
            self.runner.lora = None  # adapter rows never come here: the base alone, without per-step plans
        try:
            logits = self.runner.forward((inputs.tokens, inputs.positions, span), None)
        finally:
            if lora is not None:
                self.runner.lora = lora
        return logits, sample_static(logits, inputs, self.seen[:bucket])

    def _graph(self, bucket: int, inputs: StaticInputs) -> _Graph | None:
        keys, values = self.runner.keys, self.runner.values
        cache = (keys.data_ptr(), values.data_ptr())
        if cache != self._cache:  # the cache was grown or released and rebuilt: the old graphs read freed memory
            self.graphs.clear()
            self._cache = cache
        key = (bucket, *self.runner.capacity)
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = self.graphs[key] = _Graph(lambda: self._run(bucket, inputs), self._pool)
            except RuntimeError as error:  # an op that cannot be captured: this step uncaptured, then no more
                self.failed = f"{type(error).__name__}: {error}"
                log.warning("CUDA graph capture failed (bucket %d); decode steps run eagerly from now on: %s",
                            bucket, self.failed)
                self.graphs.clear()
                return None
            self.captures += 1
        return graph


def static_decoder(mode: str, runner: Any, seen: torch.Tensor) -> StaticDecoder | None:
    """The engine's static decode step for mode "off" (none), "cuda" (graphs on a CUDA device, else none) or
    "eager" (the padded step without capture, on any device: for tests and comparisons)."""
    if mode not in MODES:
        raise ValueError(f"decode_graphs must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off" or (mode == "cuda" and runner.device.type != "cuda"):
        return None
    return StaticDecoder(runner, seen, capture=mode == "cuda")
