"""A static-shape decode step, replayed as a captured CUDA graph per batch-size bucket (as vLLM does).

A decode step's shapes normally depend on the batch (B rows) and on how far the longest row has got (its
attention reads positions < max(positions) + 1). The static step fixes both: the batch is padded up to a bucket
(1, 2, 4, ... up to max_rows), the padding rows take spare cache rows (token 0 at position 0 of a block each,
given back after the step, outputs dropped), and attention reads every row's block table up to a power-of-two
number of blocks with the mask built from a positions tensor. Its inputs are static buffers (tokens, positions,
the block table, and the sampler's per-row settings), so the forward and the whole
sampler (repetition penalty, greedy argmax, and the counter-based draw from the whole distribution or from
top-k / top-p candidates: sampling.counter_uniforms needs no generator state) run as one graph per (bucket,
table width): warmed up on a side stream, captured into one memory pool shared by all captures, replayed
each step, captured again when the cache's pool grows (new tensors, new addresses).

Where the graph's draw cannot stand, the forward still does and the draw is redone eagerly on the graph's
logits (sampling.next_tokens, exactly the ordinary path's): grammar-constrained rows (their masks are built on
the host each step), a top-k of CANDIDATES or more, and a top-p row without top-k whose nucleus reaches past the
candidates (next_tokens then looks further: a data-dependent shape). Logprobs are taken after the replay from
the graph's logits (record_logprobs: the top-k size varies per request). The whole step runs the ordinary path
when it has prefill chunks or a prompt part-way through its prefill (its rows sit where the padding would go)
or rows of LoRA adapters (their per-step plan is built on the host). A capture that fails (an op that cannot be
captured) is logged, that step runs uncaptured and the engine steps on the ordinary path from then on. On a
CPU ("eager" mode) the same padded step runs without capture: that is what the CPU tests check.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from worker.engines.generation.caches.paged_cache import BLOCK, blocks_for
from worker.engines.generation.requests import SequenceState
from worker.engines.generation.row_outputs import constrained_logits
from worker.engines.generation.runners.runner import DecodeInput, Runner
from worker.engines.generation.sampling.sampler import (
    CANDIDATES,
    RowParams,
    _inverse_cdf,
    counter_uniforms,
    next_tokens,
    penalize,
    truncated_distribution,
)

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


def static_eligible(rows: Sequence[SequenceState]) -> bool:
    """Whether a decode step of these rows can run the static step: none uses a LoRA adapter."""
    return all(s.request.adapter is None for s in rows)


def eager_sampler(rows: Sequence[SequenceState], params: RowParams, covered: torch.Tensor) -> bool:
    """Whether the step's draw must be redone eagerly on the graph's logits: grammar rows, rows short of their
    min_tokens (eos masked), a top-k past the candidates, or a top-p row (without top-k) whose nucleus reaches past
    them (the one read of `covered`)."""
    if params.max_top_k >= CANDIDATES or any(
            s.matcher is not None or len(s.tokens) < s.request.params.min_tokens for s in rows):
        return True
    return params.open_nucleus and not bool(covered.all())


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
    truncated: torch.Tensor  # bool: the row draws from top-k / top-p candidates (else the whole distribution)
    top_k: torch.Tensor  # 0: off
    top_p: torch.Tensor  # 1: off

    @classmethod
    def empty(cls, bucket: int, device: torch.device) -> StaticInputs:
        longs = [torch.zeros(bucket, dtype=torch.long, device=device) for _ in range(5)]
        ones = [torch.ones(bucket, 1, device=device) for _ in range(2)]
        flags = [torch.zeros(bucket, dtype=torch.bool, device=device) for _ in range(2)]
        return cls(longs[0], longs[1], ones[0], longs[2], longs[3], flags[0], ones[1], flags[1], longs[4],
                   torch.ones(bucket, device=device))

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
        self.truncated.zero_()
        self.top_k.zero_()
        self.top_p.fill_(1.0)
        if params.truncated is not None:  # RowParams lists them by position among the sampled rows
            truncated = index.index_select(0, params.truncated)
            self.truncated.index_fill_(0, truncated, True)
            self.top_k.index_copy_(0, truncated, params.top_k)
            self.top_p.index_copy_(0, truncated, params.top_p.to(self.top_p.dtype))


def sample_static(logits: torch.Tensor, inputs: StaticInputs, seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """next_tokens for every padded row at once, without host reads: (tokens, covered).

    Row for row the operations of sampling.next_tokens: the penalty, then argmax, a draw from the whole
    distribution, or one from the top-k / top-p candidates (CANDIDATES of them, as next_tokens takes while every
    top-k is below that). covered: whether each row's nucleus lies within the candidates, as
    truncated_distribution decides before it would look further (see eager_sampler).
    """
    logits = penalize(logits, seen, inputs.penalty)
    greedy = logits.argmax(dim=-1)
    scaled = logits / inputs.temperature
    uniforms = counter_uniforms(inputs.seeds, inputs.counters)
    plain = _inverse_cdf(scaled.softmax(dim=-1), uniforms)
    probs, ids = truncated_distribution(scaled, inputs.top_k, inputs.top_p, max_top_k=CANDIDATES - 1,
                                        open_nucleus=False)
    cut = ids.gather(1, _inverse_cdf(probs, uniforms)[:, None])[:, 0]
    mass = (scaled.gather(1, ids) - scaled.logsumexp(dim=-1, keepdim=True)).exp().sum(dim=-1)
    covered = (inputs.top_k > 0) | (inputs.top_p >= 1.0) | (mass >= inputs.top_p)
    drawn = torch.where(inputs.truncated, cut, plain)
    return torch.where(inputs.sampled, drawn, greedy), covered


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

    def replay(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.graph.replay()
        return self.outputs


class StaticDecoder:
    """The padded decode step over a runner's cache; captured as CUDA graphs when `capture`, else run eagerly."""

    def __init__(self, runner: Runner, seen: torch.Tensor, *, capture: bool) -> None:
        self.runner = runner
        self.seen = seen  # the engine's [max_rows, V] tokens-seen mask (a persistent tensor: graphs read it)
        self.capture = capture
        self.sizes = buckets(runner.max_rows)
        self.inputs: dict[int, StaticInputs] = {}
        self.tables: dict[tuple[int, int], torch.Tensor] = {}  # static block tables by (bucket, blocks)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.captures = 0  # graphs captured so far (a new cache pool means new ones)
        self.steps = 0  # steps run here (replayed or, uncaptured, run)
        self.eager_draws = 0  # of them, steps whose draw was redone by next_tokens (eager_sampler)
        self.failed: str | None = None  # why a capture failed: the engine then steps on the ordinary path
        self._cache: tuple[int, int] | None = None  # the pool tensors' addresses the graphs were captured on
        self._pool = None
        if capture:
            with torch.cuda.device(runner.device):
                self._pool = torch.cuda.graph_pool_handle()

    def step(self, rows: Sequence[SequenceState], params: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode one step for rows 0..len(rows)-1: (logits [len(rows), V], next tokens [len(rows)])."""
        n = len(rows)
        bucket = bucket_for(n, self.sizes)
        cache = self.runner.cache
        positions = [s.position for s in rows]
        for row, at in enumerate(positions + [0] * (bucket - n)):  # a padding row writes into a block of its own
            cache.prepare(row, at, at + 1)
        blocks = 1 << (max(blocks_for(at + 1) for at in positions) - 1).bit_length()
        table = self.tables.get((bucket, blocks))
        if table is None:
            table = self.tables[(bucket, blocks)] = cache.block_table(range(bucket), blocks)
        else:
            table.copy_(cache.block_table(range(bucket), blocks))
        inputs = self.inputs.get(bucket)
        if inputs is None:
            inputs = self.inputs[bucket] = StaticInputs.empty(bucket, self.runner.device)
        inputs.fill([s.tokens[-1] for s in rows], positions, params)
        # Streams, captures and replays on the runner's own GPU, whichever is current on this thread.
        try:
            with torch.cuda.device(self.runner.device) if self.capture else contextlib.nullcontext():
                graph = self._graph(bucket, blocks, inputs, table) if self.capture else None
                logits, tokens, covered = graph.replay() if graph is not None else self._run(inputs, table)
        finally:
            for row in range(n, bucket):
                cache.free_row(row)
        self.steps += 1
        logits = logits[:n]
        if eager_sampler(rows, params, covered[:n]):  # the forward stays the graph's; the draw is next_tokens'
            self.eager_draws += 1
            seen = self.seen[:n] if params.penalty is not None else None
            return logits, next_tokens(constrained_logits(logits, list(rows), self.runner.eos_token_ids), params, seen)
        if params.sample_rows:
            params.counters += 1  # as next_tokens does: each sampled row has drawn one more token
        return logits, tokens[:n]

    def _run(self, inputs: StaticInputs, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step itself: the runner's decode over the table's blocks, then sample_static."""
        lora = getattr(self.runner, "lora", None)
        if lora is not None:
            self.runner.lora = None  # adapter rows never come here: the base alone, without per-step plans
        try:
            step = DecodeInput(inputs.tokens, inputs.positions, table.shape[1] * BLOCK, table)
            logits = self.runner.forward(step, None)
        finally:
            if lora is not None:
                self.runner.lora = lora
        return (logits, *sample_static(logits, inputs, self.seen[:table.shape[0]]))

    def _graph(self, bucket: int, blocks: int, inputs: StaticInputs, table: torch.Tensor) -> _Graph | None:
        keys, values = self.runner.cache.keys, self.runner.cache.values
        assert keys is not None and values is not None
        cache = (keys.data_ptr(), values.data_ptr())
        if cache != self._cache:  # the pool was grown or released and rebuilt: the old graphs read freed memory
            self.graphs.clear()
            self._cache = cache
        graph = self.graphs.get((bucket, blocks))
        if graph is None:
            try:
                graph = self.graphs[(bucket, blocks)] = _Graph(lambda: self._run(inputs, table), self._pool)
            except RuntimeError as error:  # an op that cannot be captured: this step uncaptured, then no more
                self.failed = f"{type(error).__name__}: {error}"
                log.warning("CUDA graph capture failed (bucket %d); decode steps run eagerly from now on: %s",
                            bucket, self.failed)
                self.graphs.clear()
                return None
            self.captures += 1
        return graph


def static_decoder(mode: str, runner: Runner, seen: torch.Tensor) -> StaticDecoder | None:
    """The engine's static decode step for mode "off" (none), "cuda" (graphs on a CUDA device, else none) or
    "eager" (the padded step without capture, on any device: for tests and comparisons)."""
    if mode not in MODES:
        raise ValueError(f"decode_graphs must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off" or (mode == "cuda" and runner.device.type != "cuda"):
        return None
    return StaticDecoder(runner, seen, capture=mode == "cuda")
