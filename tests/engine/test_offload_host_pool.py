"""The host KV pool: block layout, LRU eviction, pinning, runs for long requests, the host-memory check."""

from __future__ import annotations

import pytest
import torch

from infertrace.engine.offload import HostKVPool, check_host_budget, host_available_bytes


def make_pool(num_blocks=6):
    return HostKVPool(num_blocks, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                      pin_memory=False)


def stored(pool, h):
    """Allocate a block, publish it under hash h and release it (as a finished store does)."""
    block_id = pool.allocate()
    pool.publish(block_id, h, (h,))
    pool.unpin(block_id)
    return block_id


def test_each_block_is_one_contiguous_run_across_layers():
    pool = make_pool()
    assert pool.tensor.shape == (6, 2 * 3 * 4 * 2 * 8)
    assert pool.tensor[2:4].is_contiguous() and pool.block_nbytes == 2 * 3 * 4 * 2 * 8 * 4
    assert pool.nbytes == 6 * pool.block_nbytes


def test_lookup_checks_tokens_and_lru_evicts_the_least_recently_used():
    pool = make_pool(3)
    evicted = []
    pool.on_evict = evicted.append
    a, b, c = stored(pool, 10), stored(pool, 11), stored(pool, 12)
    assert pool.lookup(10, (10,)) == a and pool.lookup(10, (99,)) is None and pool.lookup(13, (13,)) is None
    pool.touch(a)  # a is now the most recently used: b goes first
    d = pool.allocate()
    assert d == b and evicted == [11] and pool.lookup(11, (11,)) is None
    pool.publish(d, 13, (13,))
    pool.unpin(d)
    assert pool.allocate() == c and evicted == [11, 12]
    pool.check_consistency()


def test_pinned_blocks_are_never_evicted():
    pool = make_pool(2)
    a, b = stored(pool, 1), stored(pool, 2)
    pool.pin(a)
    pool.pin(b)
    assert pool.allocate() is None
    pool.unpin(b)
    assert pool.allocate() == b and pool.lookup(1, (1,)) == a
    pool.check_consistency()


def test_runs_skip_pinned_blocks_and_prefer_evicting_fewest_cached():
    pool = make_pool(8)
    ids = [stored(pool, h) for h in range(8)]  # every block cached
    pool.pin(ids[2])
    # windows of 3 unreferenced blocks: 3..5 or 4..6 or 5..7 (0..1 is too short)
    first = pool.allocate_run(3)
    assert first == 3 and all(pool.blocks[i].ref_count == 1 for i in range(3, 6))
    assert [pool.lookup(h, (h,)) for h in (3, 4, 5)] == [None, None, None]
    assert pool.find_run(4) is None  # 6..7 and 0..1 are the only unreferenced windows left
    pool.free_run(3, 3)
    assert pool.find_run(4) == 3  # 3..6 evicts one cached block (6), 4..7 would evict two
    pool.check_consistency()


def test_a_region_is_layer_major_inside_its_run():
    pool = make_pool(4)
    first = pool.allocate_run(2)
    region = pool.region(first, 2)
    assert region.shape == (3, 2, 8, 2, 8)
    # one layer's keys over a token range is one contiguous span of the pool's memory
    assert region[1, 0, 2:7].is_contiguous()
    region[2, 1, 5] = 7.0
    assert int((pool.tensor[first : first + 2] == 7.0).sum()) == 16


def test_host_budget_larger_than_host_memory_is_one_clear_error():
    available = host_available_bytes()
    assert available is not None and available > 0
    with pytest.raises(ValueError, match=r"offload_host_gb=.* asks for .* GiB of host memory but only .* available"):
        check_host_budget(available / 1024**3 * 2 + 1, block_bytes=1 << 20)
    with pytest.raises(ValueError, match="smaller than one KV block"):
        check_host_budget(1e-9, block_bytes=1 << 20)
    assert check_host_budget(0.01, block_bytes=1 << 20) == int(0.01 * 1024**3) // (1 << 20)
