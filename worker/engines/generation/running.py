"""The running sequences of a generation engine, one per cache row and in cache-row order, with what sampling keeps
per row: the tokens each has seen (for the repetition penalty) and the rows' sampling parameters as tensors."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from worker.engines.generation.caches.paged_cache import PagedCache
from worker.engines.generation.prefill import Chunk
from worker.engines.generation.requests import Request, SequenceState
from worker.engines.generation.sampling.detokenize import Pieces
from worker.engines.generation.sampling.sampler import RowParams


class RunningRows:
    """Row r of the batch is `rows[r]`, decoding from cache row r's blocks; a finished row's blocks go back and its
    hole is filled by the last row (its block table moves)."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.rows: list[SequenceState] = []
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
        return [s for s in self.rows if s.finish_reason is not None or s.request.done]

    def remove_finished(self, cache: PagedCache) -> list[SequenceState]:
        """Take out finished rows (and those of ended requests), moving the last row into each hole; the removed."""
        doomed = [row for row, s in enumerate(self.rows) if s.finish_reason is not None or s.request.done]
        removed = []
        for row in reversed(doomed):
            removed.append(self.rows[row])
            cache.free_row(row)
            last = len(self.rows) - 1
            if row != last:
                moved = self.rows[last]
                cache.move_row(last, row)
                self.seen[row] = self.seen[last]
                self.rows[row] = moved
            self.rows.pop()
        if removed:
            self._params = None
        return removed

    def requests(self) -> dict[int, Request]:
        """The running requests by id() (a request of n choices has n rows)."""
        return {id(s.request): s.request for s in self.rows}

    def clear(self) -> list[SequenceState]:
        """Drop every row (after a failed step, or at shutdown); returns them."""
        rows, self.rows = self.rows, []
        self._params = None
        return rows
