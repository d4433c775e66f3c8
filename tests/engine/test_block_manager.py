"""Block manager: reference counts, hash hits verified by tokens, eviction, and no block ever handed out twice."""

from __future__ import annotations

import random

from infertrace.engine.block_manager import BlockManager
from infertrace.engine.sampling_params import SamplingParams
from infertrace.engine.sequence import Sequence

BS = 4


def seq(tokens, name="s") -> Sequence:
    return Sequence(name, list(tokens), SamplingParams())


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    """What the scheduler does for a whole prefill: take cache hits, allocate the rest, mark it computed."""
    hits = bm.match_prefix(s)
    bm.claim(s, hits)
    bm.allocate(s, len(s) - s.num_computed_tokens)
    s.num_computed_tokens = len(s)
    bm.register_full_blocks(s)
    return hits


def test_allocation_covers_the_tokens_and_frees_everything():
    bm = BlockManager(8, BS)
    a = seq(range(10))
    assert admit(bm, a) == []
    assert len(a.block_table) == 3 and len(set(a.block_table)) == 3
    assert bm.num_used_blocks == 3
    assert [bm.slot(a, p) for p in (0, 3, 4, 9)] == [
        a.block_table[0] * BS, a.block_table[0] * BS + 3, a.block_table[1] * BS, a.block_table[2] * BS + 1
    ]
    bm.check_consistency([a])
    bm.free(a)
    assert bm.num_free_blocks == 8 and a.block_table == []
    bm.check_consistency([])


def test_shared_prefix_is_reference_counted():
    bm = BlockManager(16, BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43], "b")
    admit(bm, a)
    hits = admit(bm, b)
    assert hits == a.block_table[:2]
    assert b.num_computed_tokens == len(b) and b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert bm.num_used_blocks == 3 + 1  # a's three, b's own third block
    bm.check_consistency([a, b])
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.check_consistency([b])
    bm.free(b)
    assert bm.num_free_blocks == 16
    bm.check_consistency([])


def test_hash_hit_is_verified_by_tokens():
    bm = BlockManager(8, BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.match_prefix(b) == a.block_table[:2]
    # corrupt the cached tokens of block 0, as a hash collision would look: no hit, and nothing after it either
    bm.blocks[a.block_table[0]].token_ids = (1, 2, 3, 99)
    assert bm.match_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 9])) == []


def test_the_last_token_is_never_served_from_the_cache():
    bm = BlockManager(8, BS)
    admit(bm, seq(range(12), "a"))
    again = seq(range(8), "b")  # exactly two full blocks, both cached
    assert len(bm.match_prefix(again)) == 1


def test_unreferenced_cached_blocks_are_kept_and_evicted_lru():
    bm = BlockManager(4, BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    admit(bm, a)
    head = a.block_table[0]
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    # a request with the same prefix still hits after a finished
    assert len(bm.match_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 0]))) == 2
    # new content takes the two blocks that hold nothing first, then evicts the tail of a's chain, not its head
    c = seq(range(100, 112), "c")
    admit(bm, c)
    assert bm.match_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 0])) == [head]
    assert bm.num_cached_blocks == 1 + 3
    d = seq(range(200, 204), "d")
    admit(bm, d)  # the last free block is a's head: evicted now
    assert bm.match_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 0])) == []
    bm.check_consistency([c, d])


def test_claimed_blocks_leave_the_free_lists():
    bm = BlockManager(4, BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    admit(bm, a)
    bm.free(a)
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "b")
    hits = admit(bm, b)
    assert len(hits) == 2 and bm.num_free_blocks == 1
    bm.check_consistency([b])


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, prefix_caching=False)
    admit(bm, seq(range(9), "a"))
    assert bm.match_prefix(seq(range(9), "b")) == [] and bm.num_cached_blocks == 0


def test_random_workload_never_double_allocates():
    rng = random.Random(7)
    bm = BlockManager(64, BS)
    live: list[Sequence] = []
    for step in range(400):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 12):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            base = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []])
            s = seq(base + [rng.randrange(5) for _ in range(rng.randrange(1, 20))], f"s{step}")
            hits = bm.match_prefix(s)
            reclaim = sum(1 for b in hits if not bm.is_referenced(b))
            if bm.num_new_blocks(s, len(s) - len(hits) * BS, len(hits)) + reclaim > bm.num_free_blocks:
                continue
            admit(bm, s)
            live.append(s)
        owned = [b for s in live for b in s.block_table]
        # a block appears in several tables only when it is a shared, cached block
        for b in set(owned):
            if owned.count(b) > 1:
                assert bm.blocks[b].hash is not None
        bm.check_consistency(live)
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == 64
    bm.check_consistency([])


def test_block_hashes_are_chained_and_computed_when_first_asked_for():
    """Hashing blocks in one go (as a lookup or a publish asks for several) gives the chain of hashing them one at
    a time; a prompt that misses the cache at its first block has only that block hashed before it runs."""
    tokens = [random.Random(3).randrange(1000) for _ in range(8 * BS + 2)]
    one_by_one, in_one_go = seq(tokens), seq(tokens)
    chain = [one_by_one.block_hash(i, BS) for i in range(8)]
    assert in_one_go.block_hash(5, BS) == chain[5] and in_one_go.block_hash(7, BS) == chain[7]
    assert [in_one_go.block_hash(i, BS) for i in range(8)] == chain and len(set(chain)) == 8
    assert seq(tokens[:BS] + [t + 1 for t in tokens[BS:]]).block_hash(7, BS) != chain[7]  # a later block differs

    bm = BlockManager(16, BS)
    fresh = seq(tokens, "fresh")
    assert bm.match_prefix(fresh) == [] and len(fresh._block_hashes) == 1
    admit(bm, fresh)
    assert len(fresh._block_hashes) == 8  # published: every full block hashed
    again = seq(tokens, "again")
    assert bm.match_prefix(again) == fresh.block_table[:8]
