"""How the paged-attention kernel lays out its programs: rows per program, and the tile list whose length a CUDA
graph fixes per token-count bucket while the sequences in it change. Plain integers, no torch or Triton, so the
runner plans steps on any machine."""

from __future__ import annotations


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
    seqs: list[int] = []
    index: list[int] = []
    for seq, qlen in enumerate(query_lens):
        n = -(-qlen * group // block_m)
        seqs += [seq] * n
        index += range(n)
    assert len(seqs) <= length, (len(seqs), length)
    pad = length - len(seqs)
    return seqs + [-1] * pad, index + [0] * pad
