"""The paged KV cache every serving runner shares (vLLM's PagedAttention layout): fixed blocks of BLOCK positions
taken from one pool as a sequence's positions fill, a block table per sequence row, blocks shared by reference (the
n choices of one prompt, cached prompt prefixes) and copied on the first write into a shared one.

A request holds the blocks its positions need, not a row as long as the longest sequence beside it; a finished
row's blocks go back to the pool at once, and moving a row (compaction after a finish) moves its table, not its
keys and values. Decode attention reads the blocks in place on a CPU (paged_attention.py); elsewhere, and for
prompt chunks that read the cache, the rows' blocks are gathered into a dense copy for SDPA.
"""

from __future__ import annotations

import ctypes
import heapq
from collections.abc import Callable, Sequence

import torch

from worker.engines.generation.caches import paged_attention

BLOCK = 16  # positions per block (vLLM's default; the prefix cache keys prompts by the same blocks)
GROWTH = 1.25  # the pool grows by at least this factor (a copy of what it holds), never by doubling
MIN_BLOCKS = 4  # the smallest pool (the zero block and three)
ZERO = 0  # block 0 stays zero and is never handed out: tables are padded with it


def sees(at: torch.Tensor, span: int, window: int | None) -> torch.Tensor:
    """[len(at), span]: a query at position at[i] sees positions 0..at[i] (only the last `window` of them)."""
    seen = torch.arange(span, device=at.device)[None]
    visible = seen <= at[:, None]
    if window:
        visible &= seen > at[:, None] - window
    return visible


def trim_heap() -> None:
    """Hand freed heap memory back to the system (glibc keeps it resident until asked; elsewhere a no-op)."""
    # Per-thread arenas, and chunks below glibc's adaptive mmap threshold, stay resident after free().
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def blocks_for(length: int) -> int:
    return -(-length // BLOCK)


class Staged:
    """A part-way prompt's keys and values so far, dense [layer, cache head, capacity, head_dim]: its next chunks
    attend through views of it instead of gathering the row's blocks again for every chunk and layer (the blocks
    are written too: decoding reads them). At most one prompt is part-way at a time, so this is one prompt's copy."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        self.keys, self.values, self.length = keys, values, length

    def reserve(self, length: int) -> None:
        """Room for `length` positions (grown by doubling: it lives only while its prompt is prefilled)."""
        have = self.keys.shape[2]
        if length > have:
            grown = max(length, 2 * have)
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_empty(old.shape[0], old.shape[1], grown, old.shape[3])
                new[:, :, :self.length] = old[:, :, :self.length]
                setattr(self, name, new)


class PagedCache:
    """keys [layer, block, cache head, head_dim, BLOCK] (a block's keys d-major, as the kernel reads them) and
    values [layer, block, cache head, BLOCK, head_dim]; `tables[row]` lists the blocks of row `row`'s positions in
    order, `refs[block]` how many tables and prefix-cache entries hold it.

    A runner holds one; the engine's scheduler moves, shares and frees rows through it. Blocks are handed out lowest
    first (the pool's resident part stays compact) and zeroed the first time the pool hands them out: attention
    meets masked positions of a block in its P@V product, where 0 * NaN would be NaN, so every block a reader can
    see holds finite values. The pool grows by GROWTH with a copy and is dropped (or compacted to what the prefix
    cache holds) when the engine is idle.
    """

    def __init__(self, *, n_layer: int, cache_heads: int, head_dim: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.n_layer, self.cache_heads, self.head_dim = n_layer, cache_heads, head_dim
        self.device, self.dtype = device, dtype
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.tables: list[list[int]] = []
        self.refs: list[int] = []
        self._free: list[int] = []  # a heap of free blocks
        self._clean = 0  # blocks below this index hold finite values (zeroed or written)
        self.staged: dict[int, Staged] = {}  # by row: part-way prompts' dense copies (Staged)
        if device.type == "cpu":
            paged_attention.kernel()  # built or loaded now, with the model, not in a request's first decode step

    # -- the pool --

    @property
    def blocks(self) -> int:
        """Blocks the pool holds now, the zero block included (0 when released)."""
        return 0 if self.keys is None else self.keys.shape[1]

    @property
    def used_blocks(self) -> int:
        """Blocks held by tables or the prefix cache."""
        return self.blocks - 1 - len(self._free) if self.blocks else 0

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's keys and values over every layer."""
        return 2 * self.n_layer * self.cache_heads * self.head_dim * BLOCK * torch.finfo(self.dtype).bits // 8

    def _allocate(self, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Uninitialised pool memory (tests poison it to prove nothing unwritten is ever read unmasked)."""
        keys = torch.empty(self.n_layer, blocks, self.cache_heads, self.head_dim, BLOCK, dtype=self.dtype,
                           device=self.device)
        values = torch.empty(self.n_layer, blocks, self.cache_heads, BLOCK, self.head_dim, dtype=self.dtype,
                             device=self.device)
        return keys, values

    def _grow(self, needed: int) -> None:
        """Make room for `needed` more blocks than are free (a copy of the blocks below the clean mark)."""
        have = self.blocks
        if have:
            total = max(have + needed - len(self._free), int(have * GROWTH))
        else:
            total = max(1 + needed, MIN_BLOCKS)
        keys, values = self._allocate(total)
        if self.keys is None or self.values is None:
            keys[:, ZERO].zero_()
            values[:, ZERO].zero_()
            self._clean, self.refs, self._free = 1, [1], []
            have = 1
        else:
            keys[:, :self._clean] = self.keys[:, :self._clean]
            values[:, :self._clean] = self.values[:, :self._clean]
        self.keys, self.values = keys, values
        self.refs += [0] * (total - have)
        for block in range(have, total):
            heapq.heappush(self._free, block)

    def _take(self, count: int) -> list[int]:
        """`count` blocks of the pool (lowest first), each held once; any never handed out before are zeroed."""
        if count > len(self._free):
            self._grow(count)
        taken = [heapq.heappop(self._free) for _ in range(count)]
        fresh = [block for block in taken if block >= self._clean]
        if fresh:
            assert self.keys is not None and self.values is not None
            index = torch.tensor(fresh, device=self.device)
            self.keys.index_fill_(1, index, 0)
            self.values.index_fill_(1, index, 0)
            self._clean = max(self._clean, max(fresh) + 1)
        for block in taken:
            self.refs[block] = 1
        return taken

    def hold(self, block: int) -> None:
        """One more holder of `block` (a table sharing it, the prefix cache)."""
        self.refs[block] += 1

    def drop(self, block: int) -> None:
        """One holder fewer; the block goes back to the pool with its last."""
        self.refs[block] -= 1
        if not self.refs[block]:
            heapq.heappush(self._free, block)

    # -- rows --

    def table(self, row: int) -> list[int]:
        while len(self.tables) <= row:
            self.tables.append([])
        return self.tables[row]

    def free_row(self, row: int) -> None:
        """Give a row's blocks back (its sequence finished or was dropped)."""
        for block in self.table(row):
            self.drop(block)
        self.tables[row] = []
        self.staged.pop(row, None)

    def free_rows_from(self, first: int) -> None:
        """Give back the blocks of every row from `first` on (rows a failed prefill left behind)."""
        for row in range(first, len(self.tables)):
            self.free_row(row)

    def set_row(self, row: int, blocks: Sequence[int]) -> None:
        """Row `row` starts from `blocks` (shared: each gains a holder), whatever it held before going back."""
        for block in blocks:
            self.hold(block)
        self.free_row(row)
        self.tables[row] = list(blocks)

    def move_row(self, source: int, target: int) -> None:
        """Row `source`'s sequence now lives in row `target` (compaction): its table moves, no key or value does."""
        self.free_row(target)
        self.tables[target], self.tables[source] = self.tables[source], []
        if source in self.staged:
            self.staged[target] = self.staged.pop(source)

    def share(self, source: int, targets: Sequence[int]) -> None:
        """Rows `targets` start from row `source`'s blocks (the n choices of one prompt), copied on first write."""
        for target in targets:
            self.set_row(target, self.table(source))

    def stage(self, row: int, length: int) -> Staged:
        """Row `row`'s dense copy holding its positions 0..length-1 (kept from its previous chunk, else gathered)."""
        staged = self.staged.get(row)
        if staged is None or staged.length != length:
            keys, values = zip(*(self.gather(layer, self.block_table([row], blocks_for(length)))
                                 for layer in range(self.n_layer)), strict=True)
            staged = self.staged[row] = Staged(torch.cat(keys), torch.cat(values), length)
        return staged

    def unstage(self, row: int) -> None:
        """Drop a row's dense copy (its prompt ended)."""
        self.staged.pop(row, None)

    def prepare(self, row: int, start: int, end: int) -> None:
        """Make positions start..end-1 of `row` writable: blocks taken up to `end`, a shared block among those the
        positions fall in copied first (copy-on-write)."""
        table = self.table(row)
        if len(table) < blocks_for(end):
            table += self._take(blocks_for(end) - len(table))
        for index in range(start // BLOCK, blocks_for(end)):
            block = table[index]
            if self.refs[block] > 1:
                (copy,) = self._take(1)
                assert self.keys is not None and self.values is not None
                self.keys[:, copy] = self.keys[:, block]
                self.values[:, copy] = self.values[:, block]
                self.drop(block)
                table[index] = copy

    def release(self) -> None:
        """Drop the pool and every table (rebuilt on the next write) and hand the memory back to the system."""
        if self.keys is not None:
            self.keys = self.values = None
            self.tables, self.refs, self._free, self._clean = [], [], [], 0
            self.staged = {}
            trim_heap()

    def compact(self) -> dict[int, int]:
        """With no row holding blocks: keep only the blocks still held (the prefix cache's) in a pool of their size.
        Returns where each kept block went; an empty pool is released."""
        assert not any(self.tables), "compact() is for an idle cache"
        kept = [block for block, count in enumerate(self.refs) if count and block != ZERO]
        if not kept:
            self.release()
            return {}
        if len(kept) + 1 == self.blocks:
            return {block: block for block in kept}
        assert self.keys is not None and self.values is not None
        old_keys, old_values, holders = self.keys, self.values, [self.refs[block] for block in kept]
        self.release()
        self._grow(len(kept))
        assert self.keys is not None and self.values is not None
        moved = self._take(len(kept))
        index = torch.tensor(kept, device=self.device)
        self.keys[:, moved[0]:moved[-1] + 1] = old_keys.index_select(1, index)
        self.values[:, moved[0]:moved[-1] + 1] = old_values.index_select(1, index)
        for block, count in zip(moved, holders, strict=True):
            self.refs[block] = count
        del old_keys, old_values
        trim_heap()
        return dict(zip(kept, moved, strict=True))

    # -- reading and writing --

    def slots(self, spans: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of every position start..end-1 of each (row, start, end) span (prepared), in order, as
        tensors for write()."""
        at = torch.cat([torch.arange(start, end) for _, start, end in spans])
        blocks = torch.cat([torch.tensor(self.tables[row], dtype=torch.long)[torch.arange(start, end) // BLOCK]
                            for row, start, end in spans])
        return blocks.to(self.device), (at % BLOCK).to(self.device)

    def write(self, layer: int, slots: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Store keys/values [N, cache head, head_dim] of one layer at their slots (see slots())."""
        assert self.keys is not None and self.values is not None
        block, offset = slots
        self.keys[layer, block, :, :, offset] = keys.to(self.dtype)
        self.values[layer, block, :, offset] = values.to(self.dtype)

    def block_table(self, rows: Sequence[int], blocks: int) -> torch.Tensor:
        """[len(rows), blocks] int32: each row's first `blocks` blocks, padded with the zero block."""
        padded = [(self.tables[row] + [ZERO] * blocks)[:blocks] for row in rows]
        return torch.tensor(padded, dtype=torch.int32, device=self.device)

    def gather(self, layer: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense keys and values [rows, cache head, blocks * BLOCK, head_dim] of one layer's blocks in `table`."""
        assert self.keys is not None and self.values is not None
        rows, blocks = table.shape
        flat = table.reshape(-1).long()
        keys = self.keys[layer].index_select(0, flat).view(rows, blocks, self.cache_heads, self.head_dim, BLOCK)
        values = self.values[layer].index_select(0, flat).view(rows, blocks, self.cache_heads, BLOCK, self.head_dim)
        keys = keys.permute(0, 2, 1, 4, 3).reshape(rows, self.cache_heads, blocks * BLOCK, self.head_dim)
        values = values.permute(0, 2, 1, 3, 4).reshape(rows, self.cache_heads, blocks * BLOCK, self.head_dim)
        return keys, values


Attention = Callable[..., torch.Tensor]  # the runner's SDPA: attention(q, k, v, **mask)


class DecodeLayout:
    """A step's decode tokens 0..B-1 (token b writes and reads its row up to positions[b]): their write slots and
    block table. Token b is row b's unless `rows` names each token's row: a speculative step's tokens of one row sit
    at consecutive positions, and each reads the row's keys up to its own position (the later ones' are written in
    the same step, before any token reads), so its draft is checked causally as a chunk would be.

    On a CPU with the kernel, attention reads each token's row blocks in place (no padding to the longest row, no
    copy); otherwise the rows' blocks up to the span are gathered, each row once however many of the step's tokens
    read it, and SDPA masks each token to its positions (a row's tokens go as that row's queries, padded to the row
    with the most). `table` (a CUDA graph's static one) is given already prepared; otherwise the rows are prepared
    here.
    """

    def __init__(self, cache: PagedCache, positions: torch.Tensor, span: int,
                 table: torch.Tensor | None = None, rows: list[int] | None = None) -> None:
        self.cache, self.positions, self.batch = cache, positions, positions.shape[0]
        self.blocks = blocks_for(span)
        if table is None:
            owners = list(range(self.batch)) if rows is None else rows
            extent: dict[int, tuple[int, int]] = {}  # each row's positions written this step
            for row, position in zip(owners, positions.tolist(), strict=True):
                first, end = extent.get(row, (position, position + 1))
                extent[row] = (min(first, position), max(end, position + 1))
            for row, (first, end) in extent.items():
                cache.prepare(row, first, end)
            table = cache.block_table(owners, self.blocks)
        self.table = table
        self.rows = rows
        self._shared: SharedRows | None = None  # built on the gather path's first layer, never with the kernel
        index = (positions // BLOCK)[:, None]
        self.slots = (table.gather(1, index)[:, 0].long(), positions % BLOCK)
        self.kernel = paged_attention.kernel() if positions.device.type == "cpu" else None
        self.parts = paged_attention.parts_for(self.batch, cache.cache_heads)
        self._masks: dict[int | None, torch.Tensor] = {}

    def attend(self, attention: Attention, query: torch.Tensor, layer: int, window: int | None,
               scale: float) -> torch.Tensor:
        """query [B, head, head_dim] against the rows' cache (after the step's keys were written): the same shape,
        in the query's dtype."""
        cache = self.cache
        if self.kernel is not None:
            assert cache.keys is not None and cache.values is not None
            out = self.kernel.paged_decode(query, cache.keys[layer], cache.values[layer], self.table, self.positions,
                                           window or 0, scale, self.parts)
            return out.to(query.dtype)
        rows = self.rows
        if rows is not None and len(set(rows)) < len(rows):
            if self._shared is None:
                self._shared = SharedRows(cache, rows, self.positions, self.blocks)
            return self._shared.attend(attention, query, layer, window)
        keys, values = cache.gather(layer, self.table)
        return attention(query[:, :, None], keys, values, attn_mask=self.mask(window))[:, :, 0]

    def mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, blocks * BLOCK]: row b sees its positions 0..positions[b] (only the last `window`)."""
        found = self._masks.get(window)
        if found is None:
            found = self._masks[window] = sees(self.positions, self.blocks * BLOCK, window)[:, None, None]
        return found


class SharedRows:
    """Decode tokens several of which read one row (a speculative step's): each row's blocks gathered once, its
    tokens attending as that row's queries [rows, head, most tokens of a row, head_dim], the shorter rows padded."""

    def __init__(self, cache: PagedCache, rows: list[int], positions: torch.Tensor, blocks: int) -> None:
        self.cache = cache
        order = list(dict.fromkeys(rows))  # each row once, in the order its first token comes
        index = {row: i for i, row in enumerate(order)}
        seen = [0] * len(order)
        which, nth = [], []
        for row in rows:
            which.append(index[row])
            nth.append(seen[index[row]])
            seen[index[row]] += 1
        device = positions.device
        self.table = cache.block_table(order, blocks)
        self.which = torch.tensor(which, device=device)
        self.nth = torch.tensor(nth, device=device)
        self.width = max(seen)
        # A pad slot reads position 0 (it must see something); its output is dropped.
        self.positions = torch.zeros(len(order), self.width, dtype=positions.dtype, device=device)
        self.positions[self.which, self.nth] = positions
        self.span = blocks * BLOCK
        self._masks: dict[int | None, torch.Tensor] = {}

    def attend(self, attention: Attention, query: torch.Tensor, layer: int, window: int | None) -> torch.Tensor:
        """query [tokens, head, head_dim] -> the same shape: each token against its row, up to its position."""
        keys, values = self.cache.gather(layer, self.table)
        queries = query.new_zeros(len(self.table), self.width, *query.shape[1:])
        queries[self.which, self.nth] = query
        out = attention(queries.transpose(1, 2), keys, values, attn_mask=self.mask(window))
        return out.transpose(1, 2)[self.which, self.nth]

    def mask(self, window: int | None) -> torch.Tensor:
        """[rows, 1, width, span]: each row's token slot j sees the row's positions up to its own."""
        found = self._masks.get(window)
        if found is None:
            rows, width = self.positions.shape
            seen = sees(self.positions.reshape(-1), self.span, window).view(rows, width, self.span)
            found = self._masks[window] = seen[:, None]
        return found


class PrefillLayout:
    """New prompt chunks right-padded to one width, the cache row each fills (n choices share one prefill: the first
    row is written, the others share its blocks when the prompt ends) and where each begins in its prompt.

    With every start 0 the chunks attend among themselves (causal); otherwise each reads its row, earlier chunks
    included, from a dense copy of its row kept across the prompt's chunks (PagedCache.stage).
    """

    def __init__(self, cache: PagedCache, prompts: list[list[int]], groups: list[list[int]], starts: list[int],
                 device: torch.device, scored: Sequence[int] = ()) -> None:
        self.cache = cache
        self.scored = scored  # chunks whose every position needs logits (their prompt is scored)
        self.count = len(prompts)
        self.lengths = [len(prompt) for prompt in prompts]
        self.width = max(self.lengths)
        self.starts = starts
        self.chunked = any(self.starts)
        self.groups = groups
        self.rows = [group[0] for group in groups]
        # Right padding needs no mask: with causal attention a real position never sees a later pad.
        self.ids = torch.tensor([p + [0] * (self.width - len(p)) for p in prompts], dtype=torch.long, device=device)
        at = torch.arange(self.width, device=device)
        # A pad sits at its chunk's last real position: it sees nothing a real token does not.
        offsets = torch.minimum(at[None], torch.tensor(self.lengths, device=device)[:, None] - 1)
        self.positions = torch.tensor(self.starts, device=device)[:, None] + offsets  # [P, width]
        for row, start, length in zip(self.rows, starts, self.lengths, strict=True):
            cache.prepare(row, start, start + length)
        # Where each real token's key and value go: its flat index among the [P * width] tokens, and its slot.
        self.real = torch.cat([torch.arange(i * self.width, i * self.width + length, device=device)
                               for i, length in enumerate(self.lengths)])
        self.ends = [start + length for start, length in zip(starts, self.lengths, strict=True)]
        self.slots = cache.slots(list(zip(self.rows, starts, self.ends, strict=True)))
        self.span = max(self.ends)
        self._masks: dict[int | None, list[torch.Tensor | None]] = {}
        # A later chunk reads a dense copy of its row kept across the prompt's chunks.
        self.staged: list[Staged | None] = [None] * self.count
        if self.chunked:
            for i, (row, start, end) in enumerate(zip(self.rows, starts, self.ends, strict=True)):
                staged = self.staged[i] = cache.stage(row, start)
                staged.reserve(end)
                staged.length = end  # this forward writes positions start..end-1 in every layer before reading

    def store(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write a layer's keys and values of the chunks [P * width, cache head, head_dim] (pads left out)."""
        self.cache.write(layer, self.slots, keys.index_select(0, self.real), values.index_select(0, self.real))
        for i, staged in enumerate(self.staged):
            if staged is not None:
                start, length, first = self.starts[i], self.lengths[i], i * self.width
                staged.keys[layer, :, start:start + length] = keys[first:first + length].transpose(0, 1)
                staged.values[layer, :, start:start + length] = values[first:first + length].transpose(0, 1)

    def attend(self, attention: Attention, query: torch.Tensor, layer: int, window: int | None) -> torch.Tensor:
        """Chunked: each chunk's queries [P, head, width, head_dim] against its own row up to the chunk's end (after
        store), read from the row's dense copy. attention(q, k, v, **mask) is the runner's SDPA. Pads' outputs are
        0."""
        out = query.new_zeros(query.shape)
        masks = self._masks.get(window)
        if masks is None:
            masks = self._masks[window] = [self._mask(start, length, window)
                                           for start, length in zip(self.starts, self.lengths, strict=True)]
        for i, (length, end, mask) in enumerate(zip(self.lengths, self.ends, masks, strict=True)):
            staged = self.staged[i]
            assert staged is not None
            kwargs = {"is_causal": True} if mask is None else {"attn_mask": mask}
            out[i:i + 1, :, :length] = attention(query[i:i + 1, :, :length], staged.keys[layer:layer + 1, :, :end],
                                                 staged.values[layer:layer + 1, :, :end], **kwargs)
        return out

    def _mask(self, start: int, length: int, window: int | None) -> torch.Tensor | None:
        """[1, 1, length, start + length]: token j (at start + j) sees positions up to its own (the last `window`);
        None where that is plain causal attention (a first chunk, no window)."""
        if not start and not window:
            return None
        at = torch.arange(start, start + length, device=self.positions.device)
        return sees(at, start + length, window)[None, None]

    def picked(self, batch: int, device: torch.device) -> torch.Tensor:
        """Flat token indices that need logits: the `batch` decode rows first, then each prompt's last position, then
        every position of each scored chunk, in order."""
        picked = [batch + i * self.width + n - 1 for i, n in enumerate(self.lengths)]
        for i in self.scored:
            picked += range(batch + i * self.width, batch + i * self.width + self.lengths[i])
        last = torch.tensor(picked, device=device)
        return last if batch == 0 else torch.cat([torch.arange(batch, device=device), last])
