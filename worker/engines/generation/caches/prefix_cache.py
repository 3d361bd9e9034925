"""Automatic prefix caching (vLLM's): the KV blocks of prompt prefixes that requests share (system prompts, chat
templates, few-shot examples) stay in the paged cache after their request ends, and a new request's row starts
from them by reference (no copy), so only the rest of its prompt is prefilled.

A block is keyed by a SHA-256 chain: its tokens, everything before it and the request's adapter (a LoRA changes
the keys and values), so a hit is exact: the same tokens at the same positions through the same weights. The chain
is also seeded with the request's tenant (as vLLM's `cache_salt`), so one tenant's blocks are never a hit for
another's: a hit shortens the time to first token and shows in `cached_tokens`, so shared blocks would tell any
tenant, block by block, what another has sent. `across_tenants` drops the tenant from the seed, for deployments
whose tenants trust each other (docs/operations/security.md). At least
a prompt's last token is always prefilled (it gives the logits of the first new token). The store evicts the
least recently used blocks beyond its byte budget, a chain's later blocks before its earlier ones (a later block
is of no use without the ones before it); an evicted block still in a running row's table stays there until the
row lets it go. A request takes references to its hit blocks when it starts, so an eviction before its prefill
costs it nothing.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict

from worker.engines.generation.caches.paged_cache import BLOCK, PagedCache, blocks_for
from worker.engines.generation.requests import Request


def block_keys(prompt: list[int], adapter: str | None, salt: str | None = None) -> list[bytes]:
    """The chain key of each full block of a prompt (the salt and the adapter's name seed the chain)."""
    keys, parent = [], hashlib.sha256(json.dumps([salt, adapter]).encode()).digest()
    for end in range(BLOCK, len(prompt) + 1, BLOCK):
        parent = hashlib.sha256(parent + array("q", prompt[end - BLOCK:end]).tobytes()).digest()
        keys.append(parent)
    return keys


def adapter_of(request: Request) -> str | None:
    return None if request.adapter is None else request.adapter.name


def salt_of(request: Request, across_tenants: bool) -> str | None:
    """What keeps a request's cached blocks its tenant's own (None: shared by every tenant)."""
    return None if across_tenants else request.tenant


class PrefixCache:
    """Blocks of the paged cache by chain key, least recently used first, holding one reference to each, within
    `capacity` bytes (a block a running row shares is counted here and held in memory once); a tenant's blocks are
    its own unless `across_tenants`."""

    def __init__(self, capacity: int, across_tenants: bool = False) -> None:
        self.capacity = capacity
        self.across_tenants = across_tenants
        self.blocks: OrderedDict[bytes, int] = OrderedDict()

    def lookup(self, cache: PagedCache, request: Request) -> None:
        """Give a starting request its longest cached prefix: request.prefix (the blocks, held for it) and
        cached_tokens."""
        hits = []
        for key in self._keys(request):
            block = self.blocks.get(key)
            if block is None:
                break
            hits.append(key)
            cache.hold(block)
            request.prefix.append(block)
        self._touch(hits)
        request.cached_tokens = min(len(hits) * BLOCK, len(request.prompt) - 1)

    def restore(self, cache: PagedCache, request: Request, row: int) -> None:
        """Start a request's first row from its cached prefix (before its first chunk is prefilled)."""
        cache.set_row(row, request.prefix[:blocks_for(request.cached_tokens)])
        self.forget(cache, request)

    @staticmethod
    def forget(cache: PagedCache, request: Request) -> None:
        """Let go of the blocks a request's lookup held (restored, or the request ended before its prefill)."""
        for block in request.prefix:
            cache.drop(block)
        request.prefix = []

    def remember(self, cache: PagedCache, request: Request, row: int) -> None:
        """Keep the full blocks of a prompt just prefilled into `row` that the store lacks; evict beyond capacity."""
        keys = self._keys(request)
        table = cache.table(row)
        for index, key in enumerate(keys):
            if key not in self.blocks:
                cache.hold(table[index])
                self.blocks[key] = table[index]
        self._touch(keys)
        while len(self.blocks) * cache.block_bytes > self.capacity and self.blocks:
            _, block = self.blocks.popitem(last=False)
            cache.drop(block)

    def renumber(self, moved: dict[int, int]) -> None:
        """The cache was compacted: each block now sits where `moved` says."""
        self.blocks = OrderedDict((key, moved[block]) for key, block in self.blocks.items())

    def clear(self) -> None:
        """Forget every block (the cache was released)."""
        self.blocks.clear()

    def _keys(self, request: Request) -> list[bytes]:
        return block_keys(request.prompt, adapter_of(request), salt_of(request, self.across_tenants))

    def _touch(self, keys: list[bytes]) -> None:
        # Most recent last, a chain's first block most recent of all: its later blocks go first.
        for key in reversed(keys):
            self.blocks.move_to_end(key)
