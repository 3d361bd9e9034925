"""The slot-addressed KV cache every serving runner shares: one row per running sequence, grown by doubling."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable

import torch

# Positions a row is zeroed beyond what a reader needs: a decode step reads one more each time.
CLEAN_AHEAD = 64
# Decode rows read together pad to the longest. On a CPU a row reading more than SPLIT_RATIO times the positions of
# the shortest row in its group (and over SPLIT_MIN) starts a new group (DecodeLayout).
SPLIT_RATIO, SPLIT_MIN = 2, 256


def sees(at: torch.Tensor, span: int, window: int | None) -> torch.Tensor:
    """[len(at), span]: a query at position at[i] sees positions 0..at[i] (only the last `window` of them)."""
    seen = torch.arange(span, device=at.device)[None]
    visible = seen <= at[:, None]
    if window:
        visible &= seen > at[:, None] - window
    return visible


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

    A runner holds one (it is given the cache's shape, it is not a cache); the engine's scheduler reserves, moves and
    releases rows through it.

    Growing allocates without zeroing (a long prompt arriving must not stall the running streams while gigabytes
    are cleared) and copies only the positions below the watermarks. Attention still reads masked positions (a
    short row beside a long one, a padded static step): they meet V in the P@V product, where 0 * NaN would be
    NaN. So each row keeps a watermark, `clean[r]`: its positions below it hold finite values (written, copied or
    zeroed), and a reader calls `clean_to` first, which zeroes only the gap. Writes start at position 0 and are
    contiguous, so a row's live positions are always below its watermark and zeroing above it destroys nothing.
    """

    def __init__(self, *, n_layer: int, cache_heads: int, head_dim: int, max_rows: int, max_length: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.n_layer, self.cache_heads, self.head_dim = n_layer, cache_heads, head_dim
        self.max_rows, self.max_length = max_rows, max_length
        self.device, self.dtype = device, dtype
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.clean: list[int] = []

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
        keys = self._allocate(shape)
        values = self._allocate(shape)
        if self.keys is not None and self.values is not None:
            used = max(self.clean, default=0)  # above every watermark nothing is worth copying
            keys[:, :have_rows, :, :used] = self.keys[:, :, :, :used]
            values[:, :have_rows, :, :used] = self.values[:, :, :, :used]
            self.clean = self.clean[:have_rows] + [0] * (new_rows - have_rows)
        else:
            self.clean = [0] * new_rows
        self.keys, self.values = keys, values

    def _allocate(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Uninitialised cache memory (tests poison it to prove nothing unwritten is ever read unmasked)."""
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def release(self) -> None:
        """Drop the cache (it is rebuilt on the next reserve) and hand freed heap memory back to the system."""
        if self.keys is not None:
            self.keys = self.values = None
            self.clean = []
            trim_heap()

    def clean_to(self, rows: Iterable[int], span: int) -> None:
        """Make positions 0..span-1 of `rows` finite before attention reads them, zeroing only the gaps.

        Call it outside a CUDA graph capture: a captured zeroing would run again on every replay.
        """
        assert self.keys is not None
        length = self.keys.shape[3]
        for row in rows:
            if self.clean[row] < span:
                self._zero(row, min(length, span + CLEAN_AHEAD))

    def written(self, rows: range, start: int, end: int) -> None:
        """Note that positions start..end-1 of `rows` were just written (start at most their watermark)."""
        for row in rows:
            if start > self.clean[row]:  # not expected (writes are contiguous from 0), but keep the invariant
                self._zero(row, start)
            self.clean[row] = max(self.clean[row], end)

    def _zero(self, row: int, end: int) -> None:
        assert self.keys is not None and self.values is not None
        self.keys[:, row, :, self.clean[row]:end].zero_()
        self.values[:, row, :, self.clean[row]:end].zero_()
        self.clean[row] = end

    def write_positions(self, rows: range, begin: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys/values [layer, cache head, n, head_dim] at positions begin..begin+n-1 of every row in `rows`."""
        assert self.keys is not None and self.values is not None
        end = begin + keys.shape[2]
        self.keys[:, rows.start:rows.stop, :, begin:end] = keys[:, None]
        self.values[:, rows.start:rows.stop, :, begin:end] = values[:, None]
        self.written(rows, begin, end)

    def move_row(self, source: int, target: int, length: int) -> None:
        """Copy the first `length` positions of row `source` into row `target` (compaction after a finish)."""
        assert self.keys is not None and self.values is not None
        self.keys[:, target, :, :length] = self.keys[:, source, :, :length]
        self.values[:, target, :, :length] = self.values[:, source, :, :length]
        self.clean[target] = max(self.clean[target], length)

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
        self._masks: dict[int | None, list[torch.Tensor | None]] = {}
        # Chunks of rows 0..P-1, one row each, reading spans of about one length (a speculative step's drafts): they
        # attend as one batch over the rows' cache (a view) under a mask, not chunk by chunk.
        spans = [start + length for start, length in zip(starts, self.lengths, strict=True)]
        self.span = max(spans)
        self.batched = (self.chunked and self.count > 1 and groups == [[row] for row in range(self.count)]
                        and self.span <= max(SPLIT_MIN, SPLIT_RATIO * min(spans)))
        self._batched_masks: dict[int | None, torch.Tensor] = {}

    def store(self, cache: torch.Tensor, layer: int, states: torch.Tensor) -> None:
        """Write a layer's keys or values of the prompts [P, head, width, head_dim] into their rows' cache."""
        if not self.chunked:
            cache[layer, self.target, :, :self.width] = states.index_select(0, self.source)
            return
        for i, (start, length, group) in enumerate(zip(self.starts, self.lengths, self.groups, strict=True)):
            cache[layer, group[0]:group[-1] + 1, :, start:start + length] = states[i, :, :length]

    def note_written(self, cache: SlotCache) -> None:
        """Raise the watermarks of the rows this prefill writes and, for batched chunks, zero the gaps a shorter
        row's attention reads up to the longest span (call before the forward's first store)."""
        for start, length, group in zip(self.starts, self.lengths, self.groups, strict=True):
            end = start + length if self.chunked else self.width  # unchunked: the pads are stored too
            cache.written(range(group[0], group[-1] + 1), start, end)
        if self.batched:
            cache.clean_to(range(self.count), self.span)

    def attend(self, attention: Callable[..., torch.Tensor], query: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, layer: int, window: int | None) -> torch.Tensor:
        """Chunked: each chunk's queries [P, head, width, head_dim] against its own row's cache up to the chunk's
        end (after store). The cache is read through views, chunk by chunk: no copy of a long prompt's rows and
        no chunk reading past its own end. attention(q, k, v, **mask) is the runner's SDPA. Pads' outputs are 0.
        Batched chunks (`batched`) attend in one call over rows 0..P-1 up to the longest span, each query masked to
        its own positions (a pad sees what its chunk's last real token sees).
        """
        if self.batched:
            mask = self._batched_masks.get(window)
            if mask is None:  # [P, 1, width, span]
                visible = sees(self.positions.reshape(-1), self.span, window).view(self.count, 1, self.width, -1)
                mask = self._batched_masks[window] = visible
            return attention(query, keys[layer, :self.count, :, :self.span], values[layer, :self.count, :, :self.span],
                             attn_mask=mask)
        out = query.new_zeros(query.shape)
        masks = self._masks.get(window)
        if masks is None:
            masks = self._masks[window] = [self._mask(start, length, window)
                                           for start, length in zip(self.starts, self.lengths, strict=True)]
        for i, (start, length, group) in enumerate(zip(self.starts, self.lengths, self.groups, strict=True)):
            row, end, mask = group[0], start + length, masks[i]
            k, v = keys[layer, row:row + 1, :, :end], values[layer, row:row + 1, :, :end]
            kwargs = {"is_causal": True} if mask is None else {"attn_mask": mask}
            out[i:i + 1, :, :length] = attention(query[i:i + 1, :, :length], k, v, **kwargs)
        return out

    def _mask(self, start: int, length: int, window: int | None) -> torch.Tensor | None:
        """[1, 1, length, start + length]: token j (at start + j) sees positions up to its own (the last `window`);
        None where that is plain causal attention (a first chunk, no window)."""
        if not start and not window:
            return None
        at = torch.arange(start, start + length, device=self.positions.device)
        return sees(at, start + length, window)[None, None]

    def picked(self, batch: int, device: torch.device, every_position: bool = False) -> torch.Tensor:
        """Flat token indices that need logits: the `batch` decode rows first, then each prompt's last position (or,
        `every_position`, every real position of each chunk: speculative decoding checks a draft at each)."""
        if every_position:
            last = torch.tensor([batch + i * self.width + j for i, n in enumerate(self.lengths) for j in range(n)],
                                device=device)
        else:
            last = torch.tensor([batch + i * self.width + n - 1 for i, n in enumerate(self.lengths)], device=device)
        return last if batch == 0 else torch.cat([torch.arange(batch, device=device), last])


def span_groups(positions: list[int]) -> list[list[int]]:
    """Decode rows grouped by how far back they read: sorted by position, a new group where one row reads more than
    SPLIT_RATIO times (and over SPLIT_MIN) what its group's shortest row reads."""
    order = sorted(range(len(positions)), key=positions.__getitem__)
    groups = [[order[0]]]
    for row in order[1:]:
        if positions[row] + 1 > max(SPLIT_MIN, SPLIT_RATIO * (positions[groups[-1][0]] + 1)):
            groups.append([row])
        else:
            groups[-1].append(row)
    return groups


class DecodeLayout:
    """A step's decode rows 0..B-1 (row b at positions[b]), grouped by how far back they read, and their masks.

    One group (the usual case; always on a GPU, where reading the positions back would sync the device and a CUDA
    graph needs fixed shapes): rows 0..B-1 over the given span, through a view. On a CPU, rows of very different
    lengths (a 2,000-token prompt joining short streams) go in groups, each reading only up to its own longest
    row: the short rows neither attend over nor are zeroed up to the long one's span.
    """

    def __init__(self, positions: torch.Tensor, span: int) -> None:
        self.positions, self.batch = positions, positions.shape[0]
        self.groups, self.spans = [list(range(self.batch))], [span]
        if positions.device.type == "cpu" and self.batch > 1:
            at = positions.tolist()
            groups = span_groups(at)
            if len(groups) > 1:
                self.groups, self.spans = groups, [max(at[row] for row in group) + 1 for group in groups]
        self.index: list[torch.Tensor] = []  # only for several groups: a host-to-device copy would fail a capture
        if len(self.groups) > 1:
            self.index = [torch.tensor(group, device=positions.device) for group in self.groups]
        self._masks: dict[tuple[int, int | None], torch.Tensor] = {}

    def clean(self, cache: SlotCache) -> None:
        """Zero the gaps each group's rows will read (before the forward)."""
        for group, span in zip(self.groups, self.spans, strict=True):
            cache.clean_to(group, span)

    def attend(self, attention: Callable[..., torch.Tensor], query: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, layer: int, window: int | None) -> torch.Tensor:
        """query [B, head, 1, head_dim] against the rows' cache (after the step's keys were written): the same shape.

        attention(q, k, v, attn_mask=...) is the runner's SDPA."""
        if len(self.groups) == 1:
            span = self.spans[0]
            return attention(query, keys[layer, :self.batch, :, :span], values[layer, :self.batch, :, :span],
                             attn_mask=self.mask(0, window))
        out = query.new_empty(query.shape)
        for g, (group, span, index) in enumerate(zip(self.groups, self.spans, self.index, strict=True)):
            if len(group) == 1:  # a view of the one row, no copy
                row = group[0]
                k, v, q = keys[layer, row:row + 1, :, :span], values[layer, row:row + 1, :, :span], query[row:row + 1]
            else:
                k, v, q = (t.index_select(0, index) for t in (keys[layer, :, :, :span], values[layer, :, :, :span],
                                                               query))
            out.index_copy_(0, index, attention(q, k, v, attn_mask=self.mask(g, window)))
        return out

    def mask(self, group: int, window: int | None) -> torch.Tensor:
        """[rows, 1, 1, span] of a group: row b sees its positions 0..positions[b] (only the last `window`)."""
        found = self._masks.get((group, window))
        if found is None:
            positions = self.positions if len(self.groups) == 1 else self.positions.index_select(0, self.index[group])
            found = self._masks[(group, window)] = sees(positions, self.spans[group], window)[:, None, None]
        return found
