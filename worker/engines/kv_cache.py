"""The slot-addressed KV cache every serving runner shares: one row per running sequence, grown by doubling."""

from __future__ import annotations

import ctypes

import torch


def _next_pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def trim_heap() -> None:
    """Hand freed heap memory back to the system (glibc keeps it resident until asked; elsewhere a no-op)."""
    # Per-thread arenas, and chunks below glibc's adaptive mmap threshold, stay resident after free().
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class SlotCache:
    """keys/values [layer, row, cache head, position, head_dim]: row r holds positions 0..len-1 of one sequence.

    A subclass sets device, dtype, n_layer, cache_heads, head_dim, max_rows and max_length before use.
    """

    device: torch.device
    dtype: torch.dtype
    n_layer: int
    cache_heads: int
    head_dim: int
    max_rows: int
    max_length: int
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, positions) the cache holds now; (0, 0) when released."""
        return (0, 0) if self.keys is None else (self.keys.shape[1], self.keys.shape[3])

    def reserve(self, rows: int, length: int) -> None:
        """Grow the cache (by doubling, keeping its contents) to hold `rows` sequences of `length` positions."""
        have_rows, have_length = self.capacity
        if rows <= have_rows and length <= have_length:
            return
        new_rows = min(self.max_rows, max(have_rows, _next_pow2(rows)))
        new_length = min(self.max_length, max(have_length, _next_pow2(length)))
        shape = (self.n_layer, new_rows, self.cache_heads, new_length, self.head_dim)
        # Zeros, not empty: masked positions still meet V in the P@V product and 0 * NaN would be NaN.
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.keys is not None and self.values is not None:
            keys[:, :have_rows, :, :have_length] = self.keys
            values[:, :have_rows, :, :have_length] = self.values
        self.keys, self.values = keys, values

    def release(self) -> None:
        """Drop the cache (it is rebuilt on the next reserve) and hand freed heap memory back to the system."""
        if self.keys is not None:
            self.keys = self.values = None
            trim_heap()

    def move_row(self, source: int, target: int, length: int) -> None:
        """Copy the first `length` positions of row `source` into row `target` (compaction after a finish)."""
        assert self.keys is not None and self.values is not None
        self.keys[:, target, :, :length] = self.keys[:, source, :, :length]
        self.values[:, target, :, :length] = self.values[:, source, :, :length]

    def write_decode(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the decode rows' new keys and values [B, cache head, head_dim] at their slots (decode_slots)."""
        assert self.keys is not None and self.values is not None
        self.keys[layer].view(-1, self.head_dim).index_copy_(0, slots, key.reshape(-1, self.head_dim))
        self.values[layer].view(-1, self.head_dim).index_copy_(0, slots, value.reshape(-1, self.head_dim))

    def decode_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Where rows 0..B-1's new key/value vectors go in one layer's cache seen as [row*head*position, head_dim].

        One index_copy_ per layer instead of an index_put with two advanced indices (slower).
        """
        assert self.keys is not None
        length = self.keys.shape[3]
        heads = torch.arange(self.cache_heads, device=self.device)
        rows = torch.arange(positions.shape[0], device=self.device)
        return ((rows[:, None] * self.cache_heads + heads[None]) * length + positions[:, None]).reshape(-1)


class PrefillLayout:
    """New prompt chunks right-padded to one width, and the cache rows each fills (n choices share one prefill).

    starts[i] is where chunk i begins in its prompt (0: a whole prompt or its first chunk). With every start 0
    the chunks attend among themselves (causal); otherwise each reads its row's cache, earlier chunks included.
    """

    def __init__(self, prompts: list[list[int]], groups: list[list[int]], starts: list[int],
                 device: torch.device) -> None:
        self.count = len(prompts)
        self.lengths = [len(prompt) for prompt in prompts]
        self.width = max(self.lengths)
        self.starts = starts
        self.chunked = any(self.starts)
        self.groups = groups
        # Right padding needs no mask: with causal attention a real position never sees a later pad.
        self.ids = torch.tensor([p + [0] * (self.width - len(p)) for p in prompts], dtype=torch.long, device=device)
        self.target = torch.tensor([row for group in groups for row in group], dtype=torch.long, device=device)
        self.source = torch.tensor([i for i, group in enumerate(groups) for _ in group], dtype=torch.long,
                                   device=device)
        at = torch.arange(self.width, device=device)
        # A pad sits at its chunk's last real position: it sees nothing a real token does not.
        offsets = torch.minimum(at[None], torch.tensor(self.lengths, device=device)[:, None] - 1)
        self.positions = torch.tensor(self.starts, device=device)[:, None] + offsets  # [P, width]

    def store(self, cache: torch.Tensor, layer: int, states: torch.Tensor) -> None:
        """Write a layer's keys or values of the prompts [P, head, width, head_dim] into their rows' cache."""
        if not self.chunked:
            cache[layer, self.target, :, :self.width] = states.index_select(0, self.source)
            return
        for i, (start, length, group) in enumerate(zip(self.starts, self.lengths, self.groups, strict=True)):
            cache[layer, group[0]:group[-1] + 1, :, start:start + length] = states[i, :, :length]

    def cached(self, cache: torch.Tensor, layer: int) -> torch.Tensor:
        """Each chunk's row of the cache up to the furthest chunk end [P, head, span, head_dim] (after store)."""
        span = max(s + n for s, n in zip(self.starts, self.lengths, strict=True))
        return cache[layer, [group[0] for group in self.groups], :, :span]

    def mask(self, window: int | None) -> torch.Tensor:
        """[P, 1, width, span]: chunk token i sees its row's positions up to its own (the last `window` of them)."""
        span = max(s + n for s, n in zip(self.starts, self.lengths, strict=True))
        seen = torch.arange(span, device=self.positions.device)[None, None]
        visible = seen <= self.positions[:, :, None]
        if window:
            visible &= seen > self.positions[:, :, None] - window
        return visible[:, None]

    def picked(self, batch: int, device: torch.device) -> torch.Tensor:
        """Flat token indices that need logits: the `batch` decode rows first, then each prompt's last position."""
        last = torch.tensor([batch + i * self.width + n - 1 for i, n in enumerate(self.lengths)], device=device)
        return last if batch == 0 else torch.cat([torch.arange(batch, device=device), last])
