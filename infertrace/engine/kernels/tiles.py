"""How the paged-attention kernel lays out its programs: rows per program, and the tile list whose length a CUDA
graph fixes per token-count bucket while the sequences in it change. Plain integers and numpy, no torch or Triton,
so the runner plans steps on any machine."""

from __future__ import annotations

import numpy as np


def prefill_block_m(max_q_len: int, group: int) -> int:
    """Rows (query token x head of a GQA group) per program: 16 when a sequence's rows fit, else 64."""
    return 16 if max_q_len * group <= 16 else 64


def max_attention_tiles(num_tokens: int, max_seqs: int, group: int, block_m: int) -> int:
    """Most entries `attention_tiles` makes for a step of `num_tokens` tokens over at most `max_seqs` sequences:
    every sequence's rows in full tiles, plus one part-filled tile per sequence."""
    return -(-num_tokens * group // block_m) + min(num_tokens, max_seqs)


def attention_tiles(query_lens: list[int], group: int, block_m: int, length: int) -> tuple[list[int], list[int]]:
    """(tile_seq, tile_index) lists of `length` entries for `paged_attention(tiles=...)`: every tile of every
    sequence's query rows, then entries of sequence -1."""
    tiles = attention_tile_array(np.asarray(query_lens, dtype=np.int64), group, block_m, length)
    return tiles[0].tolist(), tiles[1].tolist()


def attention_tile_array(query_lens: np.ndarray, group: int, block_m: int, length: int) -> np.ndarray:
    """`attention_tiles` as one [2, length] int64 array (tile_seq, tile_index), computed without a Python loop."""
    per_seq = -(-query_lens * group // block_m)
    used = int(per_seq.sum())
    assert used <= length, (used, length)
    tiles = np.zeros((2, length), dtype=np.int64)
    tiles[0, used:] = -1
    tiles[0, :used] = np.repeat(np.arange(len(per_seq)), per_seq)
    first = np.cumsum(per_seq) - per_seq  # each sequence's first entry
    tiles[1, :used] = np.arange(used) - np.repeat(first, per_seq)
    return tiles


def decode_order(context_lens: np.ndarray, length: int) -> np.ndarray:
    """A decode step's launch order for `paged_attention(seq_order=...)`: its rows by context length, longest
    first (ties in row order), then the padding rows up to `length` as they are."""
    n = len(context_lens)
    order = np.empty(length, dtype=np.int64)
    order[:n] = np.argsort(-np.asarray(context_lens, dtype=np.int64), kind="stable")
    order[n:] = np.arange(n, length)
    return order
