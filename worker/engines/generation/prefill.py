"""Chunked prefill: the prompts of started requests go into the cache a token budget at a time, interleaved with
decode steps, so a long prompt arriving does not stall the running streams for its whole prefill (vLLM's chunked
prefill: decode rows every step, prefill chunks filling the budget).

Requests are prefilled in order; a step takes the head's next chunk, then whole prompts (or the start of the next
one) while the budget lasts, so at most one request is part-way at a time: the last of a step's chunks. Its cache
rows sit right after the batch's rows and follow them down when rows finish (`follow`: their block tables move).
Chunks fill a request's first row; when its prompt ends, its other rows (n choices) share those blocks. Only a
chunk that ends its prompt yields logits that are sampled; the request then opens its rows in the batch, exactly
where its chunks were.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from worker.engines.generation.caches.paged_cache import PagedCache
from worker.engines.generation.caches.prefix_cache import PrefixCache
from worker.engines.generation.requests import Request

# Padded prompt tokens per forward: bounds the activations of a burst of prompts (a longer single one goes alone).
PREFILL_TOKENS = 4096
# Chunk tokens while running streams decode and nothing is measured yet, and the fewest a measured budget gives
# (below that a long prompt's time to first token grows faster than the streams gain).
FIRST_CHUNK, MIN_CHUNK = 32, 16
EMA = 0.2  # weight of the newest step in the running step-time estimates


class ChunkBudget:
    """Prompt tokens a step may prefill, from measured step times (Sarathi-Serve's rule: size the chunks so that a
    step which prefills beside running streams takes at most `ratio` times a decode-only step).

    A fixed token budget is right for one machine and one model only: on a 2-core CPU a 64-token chunk doubles a
    GPT-2 decode step, on a GPU a few hundred tokens ride along almost free. So the engine keeps running
    estimates of a decode-only step's time and of each prefilled token's added time, and gives a step
    (ratio - 1) x decode / per-token tokens, between MIN_CHUNK and `cap`. With no running stream there is
    nothing to protect: the cap. `cap` None: whole prompts, never chunked. ratio 0: always the cap (vLLM's fixed
    token budget).
    """

    def __init__(self, cap: int | None, ratio: float) -> None:
        self.cap, self.ratio = cap, ratio
        self.decode_s: float | None = None  # a decode-only step
        self.token_s: float | None = None  # what one prefilled token adds to a step

    def tokens(self, decoding: bool) -> int | None:
        """The next step's prompt-token budget (None: whole prompts)."""
        if self.cap is None or not decoding or not self.ratio:
            return self.cap
        if self.decode_s is None or self.token_s is None:
            return min(self.cap, FIRST_CHUNK)
        return min(self.cap, max(MIN_CHUNK, int((self.ratio - 1) * self.decode_s / self.token_s)))

    def observe(self, seconds: float, decoded: bool, prompt_tokens: int) -> None:
        """A finished step: its wall time, whether it decoded running rows, the prompt tokens it prefilled."""
        if not decoded:
            return  # a step of prefill alone says nothing about the stall it would cause
        if not prompt_tokens:
            self.decode_s = seconds if self.decode_s is None else (1 - EMA) * self.decode_s + EMA * seconds
        elif self.decode_s is not None:
            # A step faster than the decode estimate (noise) still costs something: a floor, not a negative.
            sample = max(seconds - self.decode_s, 0.01 * self.decode_s) / prompt_tokens
            self.token_s = sample if self.token_s is None else (1 - EMA) * self.token_s + EMA * sample


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens start..end of a request, prefilled in one forward into its cache rows (n choices share one
    prefill: the first row is filled, the others share its blocks when the prompt ends)."""

    request: Request
    start: int
    end: int
    rows: tuple[int, ...]

    @property
    def last(self) -> bool:
        """Whether the chunk ends its prompt (then its logits are sampled)."""
        return self.end == len(self.request.prompt)

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt[self.start:self.end]


class PrefillQueue:
    """Started requests whose prompts are not all in the cache yet, in order (plan's budget None: whole prompts).

    With a prefix cache a request's prompt starts after its cached prefix, whose blocks its first row takes before
    its first chunk; a prompt that ends leaves its full blocks to the prefix cache.
    """

    def __init__(self, prefix: PrefixCache | None = None) -> None:
        self.prefix = prefix
        self.requests: deque[Request] = deque()
        self.done = 0  # prompt tokens of the head already in the cache
        self.tail = 0  # the head's first cache row while it is part-way

    @property
    def cached_blocks(self) -> int:
        """Blocks the prefix cache holds (0 without one)."""
        return len(self.prefix.blocks) if self.prefix is not None else 0

    def add(self, cache: PagedCache, request: Request) -> None:
        """Queue a started request (its cached prefix looked up now: held until its prefill, whatever is evicted). A
        request that scores its prompt computes it whole: no cached prefix."""
        if self.prefix is not None and request.params.prompt_logprobs is None:
            self.prefix.lookup(cache, request)
        self.requests.append(request)

    @property
    def rows(self) -> int:
        """Cache rows the queued requests will take (they count against max_batch_size from admission)."""
        return sum(request.params.n for request in self.requests)

    @property
    def partial(self) -> Request | None:
        """The request part-way through its prompt (its rows hold `done` positions), if any."""
        return self.requests[0] if self.requests and self.done else None

    def plan(self, budget: int | None, first: int) -> list[Chunk]:
        """The next step's chunks: the head's next part first, then later prompts while `budget` tokens last; their
        cache rows from `first` on, in order (a part-way prompt's last)."""
        chunks: list[Chunk] = []
        used = width = 0
        row = first
        for index, request in enumerate(self.requests):
            start = self.done if index == 0 and self.done else request.cached_tokens
            size = len(request.prompt) - start
            if budget is not None:
                size = min(size, budget - used)
            if size <= 0 or (chunks and (len(chunks) + 1) * max(width, size) > PREFILL_TOKENS):
                break
            n = request.params.n
            chunks.append(Chunk(request, start, start + size, tuple(range(row, row + n))))
            used, width, row = used + size, max(width, size), row + n
            if start + size < len(request.prompt):
                break  # part-way: the budget is spent
        return chunks

    def restore(self, cache: PagedCache, chunks: Sequence[Chunk]) -> None:
        """Before a forward: the rows of requests starting now let go of whatever they held, and each request's first
        row takes its cached prefix."""
        for chunk in chunks:
            if chunk.start != chunk.request.cached_tokens:
                continue  # a later chunk of a prompt already under way
            for row in chunk.rows:
                cache.free_row(row)
            if self.prefix is not None and chunk.request.prefix:
                self.prefix.restore(cache, chunk.request, chunk.rows[0])

    def advance(self, cache: PagedCache, chunks: Sequence[Chunk]) -> None:
        """After a forward: drop (and cache) the prompts that ended, their other rows sharing the first's blocks;
        note where the part-way one stands."""
        for chunk in chunks:
            rows = chunk.rows
            if chunk.last:
                self.requests.remove(chunk.request)
                self.done = 0
                cache.unstage(rows[0])
                cache.share(rows[0], rows[1:])
                if self.prefix is not None:
                    self.prefix.remember(cache, chunk.request, rows[0])
            else:
                self.done, self.tail = chunk.end, rows[0]

    def remove(self, cache: PagedCache, requests: list[Request]) -> None:
        """Forget failed or cancelled requests: a part-way head's rows and a request's held prefix blocks go back."""
        gone = {id(request) for request in requests}
        partial = self.partial
        if partial is not None and id(partial) in gone:
            for k in range(partial.params.n):
                cache.free_row(self.tail + k)
            self.done = 0
        for request in requests:
            if self.prefix is not None and request.prefix:
                self.prefix.forget(cache, request)
        self.requests = deque(r for r in self.requests if id(r) not in gone)

    def follow(self, cache: PagedCache, rows: int) -> None:
        """Keep the part-way request's cache rows right after the batch's `rows` rows (moved down after a sweep)."""
        partial = self.partial
        if partial is None or self.tail == rows:
            return
        for k in range(partial.params.n):  # increasing order: a target is never a row still to move
            cache.move_row(self.tail + k, rows + k)
        self.tail = rows

    def idle(self, cache: PagedCache) -> None:
        """Nothing runs: give the cache's memory back, keeping only the prefix cache's blocks (compacted)."""
        if self.prefix is not None and self.prefix.blocks:
            self.prefix.renumber(cache.compact())
        else:
            cache.release()

    def clear(self, cache: PagedCache) -> None:
        """Drop the cache and everything the prefix cache held in it (after a failed forward, at shutdown)."""
        if self.prefix is not None:
            self.prefix.clear()
        cache.release()

