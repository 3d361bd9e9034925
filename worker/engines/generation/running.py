"""The running sequences of a generation engine, one per cache row and in cache-row order, with what sampling keeps
per row: the tokens each has seen (for the repetition penalty) and the rows' sampling parameters as tensors; and the
paused ones (the scheduler's preemption), out of the batch with their blocks kept."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from worker.engines.generation.caches.paged_cache import PagedCache
from worker.engines.generation.prefill import Chunk
from worker.engines.generation.requests import Request, SequenceState
from worker.engines.generation.sampling.detokenize import Pieces
from worker.engines.generation.sampling.sampler import RowParams


@dataclass
class Paused:
    """A sequence out of the batch: its blocks (held for it, keys and values in place) and, with a repetition penalty,
    the tokens it has seen."""

    sequence: SequenceState
    blocks: list[int]
    seen: torch.Tensor | None


class RunningRows:
    """Row r of the batch is `rows[r]`, decoding from cache row r's blocks; a finished row's blocks go back and its
    hole is filled by the last row (its block table moves). A paused row leaves the same way but keeps its blocks, and
    comes back as the batch's last row: its next token is the one it would have drawn (the draw depends on its seed
    and its count of tokens only, sampler.counter_uniforms), its keys and values never recomputed."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.rows: list[SequenceState] = []
        self.paused: dict[int, Paused] = {}  # id(sequence) -> the paused sequence
        self.device = device
        # Tokens seen per row (prompt + generated), for the repetition penalty: [max_rows, vocab]. A persistent
        # tensor: captured CUDA graphs read it (runners/cuda_graphs.py).
        self.seen = torch.zeros(max_rows, vocab_size, dtype=torch.bool, device=device)
        self._params: RowParams | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def open(self, chunks: Sequence[Chunk], pieces: Callable[[], Pieces]) -> int:
        """Rows for the requests whose prompts end in `chunks` (their prompts marked as seen); the first new row."""
        start = len(self.rows)
        for chunk in chunks:
            if chunk.last:
                self.rows.extend(chunk.request.open(pieces))
        for row, sequence in enumerate(self.rows[start:], start=start):
            if sequence.request.params.repetition_penalty != 1.0:
                self.seen[row].zero_()
                self.seen[row, torch.tensor(sequence.request.prompt, device=self.device)] = True
        if len(self.rows) > start:
            self._params = None
        return start

    def params(self) -> RowParams:
        """The rows' sampling parameters as tensors, rebuilt only when the rows changed."""
        if self._params is None:
            rows = self.rows
            self._params = RowParams([s.request.params for s in rows], self.device,
                                     seeds=[s.seed for s in rows], counters=[len(s.tokens) for s in rows])
        return self._params

    def invalidate(self) -> None:
        """The rows' parameters must be rebuilt before the next draw (rows joined or left)."""
        self._params = None

    def mark_seen(self, first: int, tokens: torch.Tensor) -> None:
        """Rows first.. have just sampled `tokens`."""
        rows = torch.arange(first, first + tokens.shape[0], device=self.device)
        self.seen[rows, tokens] = True

    def finished(self) -> list[SequenceState]:
        """The rows that are to leave: finished, or their request ended (failed, cancelled)."""
        return [s for s in self.rows if _ended(s)]

    def remove_finished(self, cache: PagedCache) -> list[SequenceState]:
        """Take out finished rows (and those of ended requests), moving the last row into each hole, and paused ones
        of ended requests (their blocks go back); the removed."""
        removed = self._take_out([row for row, s in enumerate(self.rows) if _ended(s)], cache)
        for key, paused in list(self.paused.items()):
            if _ended(paused.sequence):
                del self.paused[key]
                for block in paused.blocks:
                    cache.drop(block)
                removed.append(paused.sequence)
        return removed

    def pause(self, sequences: Sequence[SequenceState], cache: PagedCache) -> None:
        """Take these rows out of the batch, keeping their blocks (held here) and what they have seen."""
        rows = [self.rows.index(s) for s in sequences]
        for row in rows:
            sequence = self.rows[row]
            blocks = list(cache.table(row))
            for block in blocks:
                cache.hold(block)
            seen = self.seen[row].clone() if sequence.request.params.repetition_penalty != 1.0 else None
            self.paused[id(sequence)] = Paused(sequence, blocks, seen)
        self._take_out(rows, cache)

    def resume(self, sequences: Sequence[SequenceState], cache: PagedCache) -> None:
        """Paused sequences rejoin the batch as its last rows, on their blocks (the cache rows after the batch's must
        be free: no prompt part-way there)."""
        for sequence in sequences:
            paused = self.paused.pop(id(sequence))
            row = len(self.rows)
            cache.set_row(row, paused.blocks)
            for block in paused.blocks:
                cache.drop(block)
            if paused.seen is not None:
                self.seen[row] = paused.seen
            self.rows.append(sequence)
        if sequences:
            self._params = None

    def _take_out(self, doomed: list[int], cache: PagedCache) -> list[SequenceState]:
        """Rows `doomed` leave (their blocks dropped once), the last row moving into each hole; returns their
        sequences."""
        removed = [self.rows[row] for row in doomed]
        for row in sorted(doomed, reverse=True):
            cache.free_row(row)
            last = len(self.rows) - 1
            if row != last:
                cache.move_row(last, row)
                self.seen[row] = self.seen[last]
                self.rows[row] = self.rows[last]
            self.rows.pop()
        if doomed:
            self._params = None
        return removed

    def requests(self) -> dict[int, Request]:
        """The running requests by id() (a request of n choices has n rows), those with paused rows included."""
        return {id(s.request): s.request for s in [*self.rows, *(p.sequence for p in self.paused.values())]}

    def clear(self) -> list[SequenceState]:
        """Drop every row and paused sequence (after a failed step, or at shutdown: the cache is dropped whole);
        returns them."""
        rows, self.rows = [*self.rows, *(p.sequence for p in self.paused.values())], []
        self.paused.clear()
        self._params = None
        return rows


def _ended(sequence: SequenceState) -> bool:
    return sequence.finish_reason is not None or sequence.request.done
