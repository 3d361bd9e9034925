"""The paged cache (blocks taken as positions fill, zeroed only when first handed out, shared by reference and
copied on write, attention read in place by the kernel as SDPA reads a gathered copy) and the chunk budget's rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.engines.generation.caches import paged_attention
from worker.engines.generation.caches.paged_cache import BLOCK, DecodeLayout, PagedCache, PrefillLayout, blocks_for
from worker.engines.generation.prefill import FIRST_CHUNK, MIN_CHUNK, ChunkBudget


def small(dtype: torch.dtype = torch.float32, heads: int = 3, head_dim: int = 4) -> PagedCache:
    return PagedCache(n_layer=2, cache_heads=heads, head_dim=head_dim, device=torch.device("cpu"), dtype=dtype)


def write(cache: PagedCache, row: int, start: int, end: int, value: float) -> None:
    """Positions start..end-1 of `row` (prepared) hold `value` in every layer."""
    cache.prepare(row, start, end)
    slots = cache.slots([(row, start, end)])
    block = torch.full((end - start, cache.cache_heads, cache.head_dim), value)
    for layer in range(cache.n_layer):
        cache.write(layer, slots, block, block)


def held(cache: PagedCache, row: int, length: int) -> torch.Tensor:
    """Row `row`'s keys of positions 0..length-1 in layer 0, gathered: [cache head, length, head_dim]."""
    keys, _ = cache.gather(0, cache.block_table([row], blocks_for(length)))
    return keys[0, :, :length]


def test_blocks_are_taken_as_positions_fill_and_the_pool_grows_keeping_them() -> None:
    cache = small()  # allocations are NaN in tests (the autouse _poisoned_kv_cache fixture)
    write(cache, 0, 0, 10, 1.0)
    write(cache, 1, 0, 3, 2.0)
    assert [len(t) for t in cache.tables] == [1, 1] and cache.used_blocks == 2
    write(cache, 2, 0, 40 * BLOCK, 3.0)  # a long prompt: the pool grows (a copy of what it holds)
    assert len(cache.tables[2]) == 40 and cache.used_blocks == 42
    assert (held(cache, 0, 10) == 1).all() and (held(cache, 1, 3) == 2).all()
    assert not cache.keys[:, :cache._clean].isnan().any()  # every block handed out was zeroed or written
    assert cache.keys[:, cache._clean:].isnan().all()  # the rest of the pool: never touched
    assert cache.blocks * cache.block_bytes <= 1.25 * (cache.used_blocks + 1) * cache.block_bytes + cache.block_bytes


def test_memory_per_sequence_is_its_own_blocks_not_the_longest_rows() -> None:
    cache = small()
    lengths = [100, 2000, 37, 512]
    for row, length in enumerate(lengths):
        cache.prepare(row, 0, length)
    assert cache.used_blocks == sum(blocks_for(length) for length in lengths)
    freed = list(cache.tables[1])
    cache.free_row(1)  # the long one finishes: its blocks go back, lowest first for the next taker
    assert cache.used_blocks == sum(blocks_for(length) for length in (100, 37, 512))
    cache.prepare(4, 0, 16)
    assert cache.tables[4] == [min(freed)]


def test_moving_a_row_moves_its_table_and_freeing_gives_its_blocks_back() -> None:
    cache = small()
    write(cache, 1, 0, 20, 4.0)
    write(cache, 3, 0, 40, 5.0)
    blocks = list(cache.tables[3])
    cache.free_row(1)
    cache.move_row(3, 1)  # compaction: row 3's sequence now lives in row 1; no key or value moves
    assert cache.tables[1] == blocks and cache.tables[3] == [] and (held(cache, 1, 40) == 5).all()
    assert cache.used_blocks == 3
    cache.release()
    assert cache.blocks == 0 and cache.tables == []


def test_shared_blocks_are_copied_on_the_first_write_into_them() -> None:
    cache = small()
    write(cache, 0, 0, 2 * BLOCK + 5, 1.0)  # a prompt of 37 tokens: two full blocks and a partial one
    cache.share(0, [1, 2])  # n = 3 choices start from its blocks
    assert cache.tables[1] == cache.tables[0] and all(cache.refs[b] == 3 for b in cache.tables[0])
    write(cache, 1, 2 * BLOCK + 5, 2 * BLOCK + 6, 7.0)  # choice 1's first token lands in the shared partial block
    assert cache.tables[1][:2] == cache.tables[0][:2] and cache.tables[1][2] != cache.tables[0][2]
    assert (held(cache, 0, 2 * BLOCK + 6)[:, -1] == 0).all()  # row 0's block untouched (zeroed beyond its end)
    assert (held(cache, 1, 2 * BLOCK + 5) == 1).all() and (held(cache, 1, 2 * BLOCK + 6)[:, -1] == 7).all()
    assert cache.refs[cache.tables[0][2]] == 2 and cache.refs[cache.tables[1][2]] == 1


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 8), (6, 2, 64), (9, 3, 40)])
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_reads_blocks_in_place_as_sdpa_reads_them_gathered(heads, kv_heads, head_dim, window,
                                                                       dtype) -> None:
    if paged_attention.kernel() is None:
        pytest.skip("the paged attention kernel could not be built here")
    torch.manual_seed(0)
    cache = small(dtype, kv_heads, head_dim)
    positions = [0, 15, 16, 70, 300, 5]  # block edges, a long row beside short ones
    for row, at in enumerate(positions):  # rows grow in turns: their blocks interleave in the pool
        cache.prepare(row, 0, at + 1)
    cache.prepare(6, 0, 500)
    cache.free_row(6)  # freed blocks hold stale (finite) values, as after a finished request
    cache.keys[:, 1:].normal_(), cache.values[:, 1:].normal_()
    layout = DecodeLayout(cache, torch.tensor(positions), max(positions) + 1)
    assert layout.kernel is not None
    query = torch.randn(len(positions), heads, head_dim, dtype=dtype)
    sdpa = lambda q, k, v, **mask: F.scaled_dot_product_attention(  # noqa: E731
        q.float(), k.float(), v.float(), enable_gqa=heads != kv_heads, **mask)
    for parts in (1, 3):
        layout.parts = parts
        got = layout.attend(sdpa, query, 1, window, head_dim**-0.5)
        layout.kernel = None  # the gathered path: SDPA over a dense copy, masked
        expected = layout.attend(sdpa, query, 1, window, head_dim**-0.5)
        layout.kernel = paged_attention.kernel()
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-5 if dtype == torch.float32 else 1e-2,
                                   atol=2e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_tokens_of_one_row_read_it_causally_as_a_chunk_would(window, kernel) -> None:
    """A speculative step's tokens (row r's last token and its draft at consecutive positions, decode tokens of their
    own): each reads its row up to its own position, in place through the kernel or gathered, as the chunk path
    gives each position of the same chunks."""
    if kernel and paged_attention.kernel() is None:
        pytest.skip("the paged attention kernel could not be built here")
    torch.manual_seed(0)
    starts, chunks = [12, 5, 9], [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11]]
    caches = [small(), small()]
    for cache in caches:
        for row, start in enumerate(starts):
            write(cache, row, 0, start, 0.0)
        torch.manual_seed(1)
        cache.keys[:, 1:].normal_(), cache.values[:, 1:].normal_()
    owners = [row for row, chunk in enumerate(chunks) for _ in chunk]
    positions = torch.tensor([start + j for start, chunk in zip(starts, chunks, strict=True)
                              for j in range(len(chunk))])
    decode = DecodeLayout(caches[0], positions, int(positions.max()) + 1, rows=owners)
    if not kernel:
        decode.kernel = None
    prefill = PrefillLayout(caches[1], chunks, [[0], [1], [2]], starts, torch.device("cpu"))
    heads, head_dim, width = caches[0].cache_heads, caches[0].head_dim, prefill.width
    new = torch.randn(len(owners), heads, head_dim)
    query = torch.randn(len(owners), heads, head_dim)
    caches[0].write(0, decode.slots, new, new * 2)
    got = decode.attend(F.scaled_dot_product_attention, query, 0, window, head_dim**-0.5)
    padded_new, padded_query = torch.zeros(3 * width, heads, head_dim), torch.zeros(3, width, heads, head_dim)
    at = 0
    for i, chunk in enumerate(chunks):
        padded_new[i * width:i * width + len(chunk)] = new[at:at + len(chunk)]
        padded_query[i, :len(chunk)] = query[at:at + len(chunk)]
        at += len(chunk)
    prefill.store(0, padded_new, padded_new * 2)
    expected = prefill.attend(F.scaled_dot_product_attention, padded_query.transpose(1, 2), 0, window)
    at = 0
    for i, chunk in enumerate(chunks):
        torch.testing.assert_close(got[at:at + len(chunk)], expected[i, :, :len(chunk)].transpose(0, 1),
                                   atol=2e-6, rtol=2e-5)
        at += len(chunk)
    assert [len(table) for table in caches[0].tables] == [len(table) for table in caches[1].tables]


def test_a_part_way_prompt_keeps_one_dense_copy_that_follows_its_row() -> None:
    """A prompt's later chunks read a dense copy of its row kept across chunks (gathered once), equal to its blocks."""
    torch.manual_seed(0)
    cache = small()
    write(cache, 2, 0, 7, 1.0)  # its first chunk: 7 positions in blocks
    first = PrefillLayout(cache, [[5, 6, 7, 8]], [[2]], [7], torch.device("cpu"))
    staged = cache.staged[2]
    assert staged.length == 11
    new = torch.randn(4, cache.cache_heads, cache.head_dim)
    for layer in range(cache.n_layer):
        first.store(layer, new, new * 2)
    keys, values = cache.gather(1, cache.block_table([2], blocks_for(11)))
    assert torch.equal(staged.keys[1:2, :, :11], keys[:, :, :11]) and torch.equal(staged.values[1:2, :, :11],
                                                                                    values[:, :, :11])
    second = PrefillLayout(cache, [[9] * 30], [[2]], [11], torch.device("cpu"))
    assert second.staged[0] is staged and staged.keys.shape[2] >= 41  # kept, grown; not gathered again
    cache.move_row(2, 0)  # the batch's rows finished: the part-way prompt's row moves down, its copy with it
    assert cache.staged == {0: staged}
    cache.unstage(0)  # its prompt ended
    assert cache.staged == {}


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
