"""Automatic prefix caching (vLLM's): the KV of prompt prefixes that requests share (system prompts, chat
templates, few-shot examples) is kept in blocks of BLOCK tokens and copied into a new request's cache rows, so
only the rest of its prompt is prefilled.

A block is keyed by a SHA-256 chain: its tokens, everything before it and the request's adapter (a LoRA changes
the keys and values), so a hit is exact: the same tokens at the same positions through the same weights. At least
a prompt's last token is always prefilled (it gives the logits of the first new token). The store evicts the
least recently used blocks beyond its byte budget, a chain's later blocks before its earlier ones (a later block
is of no use without the ones before it). A request takes references to its hit blocks when it starts, so an
eviction before its prefill costs it nothing.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

from worker.engines.serving.caches.slot_cache import SlotCache
from worker.engines.serving.requests import Request

BLOCK = 16  # tokens per block: vLLM's default


def block_keys(prompt: list[int], adapter: str | None) -> list[bytes]:
    """The chain key of each full block of a prompt (the adapter's name seeds the chain)."""
    keys, parent = [], hashlib.sha256((adapter or "").encode()).digest()
    for end in range(BLOCK, len(prompt) + 1, BLOCK):
        parent = hashlib.sha256(parent + array("q", prompt[end - BLOCK:end]).tobytes()).digest()
        keys.append(parent)
    return keys


def adapter_of(request: Request) -> str | None:
    return None if request.adapter is None else request.adapter.name


class PrefixCache:
    """KV blocks [layer, cache head, BLOCK, head_dim] by chain key, least recently used first, in `capacity` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.bytes = 0

    def lookup(self, request: Request) -> None:
        """Give a starting request its longest cached prefix: request.prefix (the blocks) and cached_tokens."""
        hits = []
        for key in block_keys(request.prompt, adapter_of(request)):
            found = self.blocks.get(key)
            if found is None:
                break
            hits.append(key)
            request.prefix.append(found)
        self._touch(hits)
        request.cached_tokens = min(len(hits) * BLOCK, len(request.prompt) - 1)

    def restore(self, cache: SlotCache, request: Request, rows: list[int]) -> None:
        """Copy a request's cached prefix into its cache rows (before its first chunk is prefilled)."""
        for index, (keys, values) in enumerate(request.prefix):
            begin, end = index * BLOCK, min((index + 1) * BLOCK, request.cached_tokens)
            if end > begin:
                cache.write_positions(range(rows[0], rows[-1] + 1), begin, keys[:, :, :end - begin],
                                       values[:, :, :end - begin])
        request.prefix = []  # the blocks are in the rows now

    def remember(self, cache: SlotCache, request: Request, row: int) -> None:
        """Keep the full blocks of a prompt just prefilled into `row` that the store lacks; evict beyond capacity."""
        keys = block_keys(request.prompt, adapter_of(request))
        assert cache.keys is not None and cache.values is not None
        for index, key in enumerate(keys):
            if key not in self.blocks:
                span = slice(index * BLOCK, (index + 1) * BLOCK)
                block = (cache.keys[:, row, :, span].clone(), cache.values[:, row, :, span].clone())
                self.blocks[key] = block
                self.bytes += 2 * block[0].numel() * block[0].element_size()
        self._touch(keys)
        while self.bytes > self.capacity and self.blocks:
            _, (k, _v) = self.blocks.popitem(last=False)
            self.bytes -= 2 * k.numel() * k.element_size()

    def _touch(self, keys: list[bytes]) -> None:
        # Most recent last, a chain's first block most recent of all: its later blocks go first.
        for key in reversed(keys):
            self.blocks.move_to_end(key)
