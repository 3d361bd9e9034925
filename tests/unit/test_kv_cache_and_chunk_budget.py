"""The slot cache's watermarks (growth without zeroing, gaps zeroed only where read) and the chunk budget's rule."""

from __future__ import annotations

import pytest
import torch

from worker.engines.serving.caches.slot_cache import CLEAN_AHEAD, PrefillLayout, SlotCache
from worker.engines.serving.prefill import FIRST_CHUNK, MIN_CHUNK, ChunkBudget


class Cache(SlotCache):
    """A small cache: 2 layers, 3 heads of 4, up to 8 rows of 1,024 positions."""

    def __init__(self) -> None:
        super().__init__(n_layer=2, cache_heads=3, head_dim=4, max_rows=8, max_length=1024,
                         device=torch.device("cpu"), dtype=torch.float32)


def written(cache: Cache, row: int, length: int, value: float) -> None:
    block = torch.full((cache.n_layer, cache.cache_heads, length, cache.head_dim), value)
    cache.write_positions(range(row, row + 1), 0, block, block)


def test_growth_keeps_what_rows_hold_and_leaves_the_rest_unzeroed() -> None:
    cache = Cache()  # allocations are NaN in tests (the autouse _poisoned_kv_cache fixture)
    cache.reserve(2, 16)
    written(cache, 0, 10, 1.0)
    written(cache, 1, 3, 2.0)
    cache.reserve(4, 600)  # a long prompt arrives: more rows, 1,024 positions
    assert cache.capacity == (4, 1024)
    assert cache.clean == [10, 3, 0, 0]
    assert (cache.keys[:, 0, :, :10] == 1).all() and (cache.values[:, 1, :, :3] == 2).all()
    assert cache.keys[:, 0, :, 10:].isnan().all() and cache.keys[:, 2:].isnan().all()  # nothing zeroed


def test_a_reader_zeroes_only_the_gaps_below_its_span_and_never_a_live_position() -> None:
    cache = Cache()
    cache.reserve(4, 512)
    written(cache, 0, 300, 1.0)
    written(cache, 1, 20, 2.0)
    cache.clean_to(range(3), 301)  # a decode step over rows 0-2 reading positions 0..300 (row 0 writes position 300)
    assert cache.clean == [301 + CLEAN_AHEAD] * 3 + [0]
    assert (cache.keys[:, 0, :, :300] == 1).all()  # what row 0 holds is untouched
    assert (cache.keys[:, 1, :, :20] == 2).all() and (cache.keys[:, 1, :, 20:301 + CLEAN_AHEAD] == 0).all()
    assert (cache.values[:, 2, :, :301 + CLEAN_AHEAD] == 0).all() and cache.keys[:, 2, :, 400:].isnan().all()
    assert cache.keys[:, 3].isnan().all()  # not read: not zeroed
    cache.clean_to(range(3), 300)
    assert cache.clean == [301 + CLEAN_AHEAD] * 3 + [0]  # nothing more to do


def test_moving_a_row_carries_its_watermark() -> None:
    cache = Cache()
    cache.reserve(4, 64)
    written(cache, 3, 40, 5.0)
    cache.move_row(3, 1, 40)  # compaction: row 3's sequence now lives in row 1
    assert cache.clean[1] == 40 and (cache.keys[:, 1, :, :40] == 5).all()
    cache.release()
    assert cache.capacity == (0, 0) and cache.clean == []


@pytest.mark.parametrize("window", [None, 6])
def test_chunks_of_rows_0_to_p_attend_as_one_batch_as_they_would_one_by_one(window) -> None:
    """A speculative step's chunks (row r's chunk at its own position, rows 0..P-1): one masked call over the rows'
    cache gives each real position what the chunk-by-chunk path gives, the shorter rows' gaps zeroed first (the
    cache beyond every watermark is NaN here)."""
    torch.manual_seed(0)
    cache = Cache()
    cache.reserve(3, 64)
    starts, chunks = [12, 5, 9], [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11]]
    for row, start in enumerate(starts):
        block = torch.randn(cache.n_layer, cache.cache_heads, start, cache.head_dim)
        cache.write_positions(range(row, row + 1), 0, block, block * 0.5)
    layouts = [PrefillLayout(chunks, [[0], [1], [2]], starts, torch.device("cpu")) for _ in range(2)]
    assert layouts[0].batched
    layouts[1].batched = False  # the chunk-by-chunk path, the reference
    width = layouts[0].width
    q = torch.randn(3, cache.cache_heads, width, cache.head_dim)
    new = torch.randn(3, cache.cache_heads, width, cache.head_dim)
    outs = []
    for layout in layouts:
        layout.note_written(cache)
        layout.store(cache.keys, 0, new)
        layout.store(cache.values, 0, new * 2)
        outs.append(layout.attend(torch.nn.functional.scaled_dot_product_attention, q, cache.keys, cache.values, 0,
                                  window))
    for i, length in enumerate(layout.lengths):
        assert torch.allclose(outs[0][i, :, :length], outs[1][i, :, :length], atol=1e-6), i
    assert not outs[0].isnan().any()


def test_the_chunk_budget_follows_the_measured_step_times() -> None:
    budget = ChunkBudget(2048, 1.5)
    assert budget.tokens(decoding=False) == 2048  # no stream to protect: the cap
    assert budget.tokens(decoding=True) == FIRST_CHUNK  # nothing measured yet
    for _ in range(30):
        budget.observe(0.020, decoded=True, prompt_tokens=0)  # decode-only steps: 20 ms
    budget.observe(1.0, decoded=False, prompt_tokens=2000)  # a prefill alone says nothing about a stall
    assert budget.token_s is None
    for _ in range(30):
        budget.observe(0.030, decoded=True, prompt_tokens=40)  # each prompt token adds 0.25 ms
    assert budget.tokens(decoding=True) == pytest.approx(40, abs=1)  # 0.5 x 20 ms / 0.25 ms
    for _ in range(60):
        budget.observe(0.0201, decoded=True, prompt_tokens=256)  # a GPU: prompt tokens ride along
    assert budget.tokens(decoding=True) == 2048
    for _ in range(60):
        budget.observe(0.5, decoded=True, prompt_tokens=64)  # a slow machine: never below the floor
    assert budget.tokens(decoding=True) == MIN_CHUNK


@pytest.mark.parametrize(("cap", "ratio", "expected"), [(None, 1.5, None), (256, 0, 256), (7, 1.5, 7)])
def test_whole_prompts_fixed_chunks_and_small_caps_are_kept(cap, ratio, expected) -> None:
    budget = ChunkBudget(cap, ratio)
    for _ in range(5):
        budget.observe(0.02, decoded=True, prompt_tokens=0)
        budget.observe(0.05, decoded=True, prompt_tokens=8)
    assert budget.tokens(decoding=True) == expected
