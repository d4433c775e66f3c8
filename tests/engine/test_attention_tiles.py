"""The tile list a token-count CUDA graph's attention runs over: every tile of every sequence, padded to a length
the bucket fixes (no GPU needed)."""

from __future__ import annotations

import itertools
import random

import pytest

from infertrace.engine.config import DEFAULT_CUDA_GRAPH_TOKEN_SIZES
from infertrace.engine.kernels.tiles import attention_tiles, max_attention_tiles, prefill_block_m


def test_every_tile_of_every_sequence_then_padding():
    seqs, index = attention_tiles([1, 40, 32, 3], group=2, block_m=64, length=8)
    assert seqs == [0, 1, 1, 2, 3, -1, -1, -1]
    assert index == [0, 0, 1, 0, 0, 0, 0, 0]


def test_block_m_follows_the_longest_query():
    assert prefill_block_m(8, 2) == 16 and prefill_block_m(9, 2) == 64 and prefill_block_m(512, 4) == 64


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_any_step_of_a_bucket_fits_its_tile_count(group):
    rng = random.Random(group)
    for _ in range(2000):
        bucket = rng.choice(DEFAULT_CUDA_GRAPH_TOKEN_SIZES)  # the engine's own buckets
        max_seqs = rng.choice([1, 8, 256])
        block_m = prefill_block_m(bucket, group)
        length = max_attention_tiles(bucket, max_seqs, group, block_m)
        num_seqs = rng.randint(1, min(bucket, max_seqs))
        cuts = sorted(rng.sample(range(1, rng.randint(num_seqs, bucket)), num_seqs - 1)) if num_seqs > 1 else []
        total = cuts[-1] + rng.randint(1, bucket - cuts[-1]) if cuts else rng.randint(1, bucket)
        q_lens = [b - a for a, b in zip([0] + cuts, cuts + [total])]
        seqs, index = attention_tiles(q_lens, group, block_m, length)  # asserts that they fit
        assert len(seqs) == len(index) == length
        assert sum(s >= 0 for s in seqs) == sum(-(-q * group // block_m) for q in q_lens)


def test_too_short_a_list_is_refused():
    with pytest.raises(AssertionError):
        attention_tiles([64, 64], group=2, block_m=64, length=3)


def test_decode_order_is_longest_context_first_then_padding():
    from infertrace.engine.kernels.tiles import decode_order

    # ties keep row order; rows 4 and 5 pad the batch to its graph's bucket
    assert decode_order([30, 700, 30, 1200], 6).tolist() == [3, 1, 0, 2, 4, 5]
    rng = random.Random(0)
    lens = [rng.randint(1, 2048) for _ in range(256)]
    order = decode_order(lens, 256).tolist()
    assert sorted(order) == list(range(256))
    assert all(lens[a] >= lens[b] for a, b in itertools.pairwise(order))
