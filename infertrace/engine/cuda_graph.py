"""CUDA graphs of the forward pass, captured at start-up into one memory pool: decode steps per batch-size bucket,
prefill and mixed steps per token-count bucket.

A decode step of B requests replays the graph of the smallest bucket >= B with the extra rows padded (they write no
KV, attend to one key and come last in the attention's launch order). A prefill or mixed step of T tokens replays
the graph of the smallest token bucket >= T: the padding tokens write no KV (slot -1), and the paged attention
inside the graph runs over a tile list whose length the bucket fixes (`attention_tiles`), so the same graph serves
any mix of sequences and lengths. Steps above the largest bucket run eagerly.
"""

from __future__ import annotations

import bisect

import torch

from infertrace.engine.attention import AttentionMetadata
from infertrace.engine.kernels.tiles import max_attention_tiles, prefill_block_m
from infertrace.engine.step_buffers import StepBuffers


def _smallest_at_least(buckets: list[int], n: int) -> int | None:
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None



def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """GPU milliseconds of one replay of `graph`, replayed `replays` times back to back after one untimed replay
    (with more ranks, the one where their collectives first meet), timed by CUDA events."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays

class DecodeGraphs:
    def __init__(self, model, buffers: StepBuffers, bucket_sizes: tuple[int, ...], max_seqs: int, block_size: int,
                 ordered: bool = False):
        self.model = model
        self.buffers = buffers
        self.block_size = block_size
        self.ordered = ordered  # the attention launches rows in the buffers' decode_order
        self.buckets = sorted(b for b in bucket_sizes if b <= max_seqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def decode_meta(self, bs: int) -> AttentionMetadata:
        b = self.buffers
        return AttentionMetadata(
            slot_mapping=b.slot_mapping[:bs],
            query_start_loc=b.decode_query_start_loc[: bs + 1],
            seq_lens=b.seq_lens[:bs],
            block_tables=b.block_tables[:bs],
            query_lens_list=[1] * bs,
            seq_lens_list=[1] * bs,
            max_query_len=1,
            max_seq_len=1,
            block_size=self.block_size,
            decode_order=b.decode_order[:bs] if self.ordered else None,
        )

    @torch.inference_mode()
    def capture(self, pool=None):
        """Capture every bucket into `pool` (a new one when None); returns the pool.

        The graphs end at the logits: the sampler's greedy argmax runs after them. Captured at the graph's end (or
        as a graph of its own), the argmax saved about 100 us of host time a step but made the batch-8 qwen3-4b
        decode step's layers about 30 us slower on an H100 (their dependent launches overlapped less), so it is not."""
        b = self.buffers
        b.pad_decode_rows(0, b.seq_lens.numel())
        for bs in reversed(self.buckets):  # largest first, so smaller graphs reuse its pool
            meta = self.decode_meta(bs)
            self.model.compute_logits(self.model(b.input_ids[:bs], b.positions[:bs], meta))  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model.compute_logits(self.model(b.input_ids[:bs], b.positions[:bs], meta))
            pool = graph.pool()
            self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize()
        return pool

    def bucket_for(self, batch_size: int) -> int | None:
        return _smallest_at_least(self.buckets, batch_size)

    def replay(self, batch_size: int) -> torch.Tensor:
        """Logits [batch_size, vocab] of the decode step whose inputs, padded to its bucket
        (`StepBuffers.put_decode_padding`), are in the buffers' first rows."""
        graph, logits = self.graphs[self.bucket_for(batch_size)]
        graph.replay()
        return logits[:batch_size]


class TokenGraphs:
    """Prefill and mixed steps: the model's forward (embedding to final norm) per token-count bucket.

    Buckets are the sizes below `max_tokens` plus `max_tokens` itself (when the largest size reaches it). The
    graphs return hidden states; the rows that sample go through the LM head eagerly, as on the eager path.
    """

    def __init__(self, model, buffers: StepBuffers, bucket_sizes: tuple[int, ...], max_tokens: int, max_seqs: int,
                 block_size: int, group: int, uses_tiles=lambda bucket: True):
        self.model = model
        self.buffers = buffers
        self.block_size = block_size
        self.max_seqs = max_seqs
        self.group = group  # query heads per KV head
        # by bucket: whether the attention runs over a tile list (Triton) or over the bucket's `batch_rows` requests,
        # those past the step's empty (FlashAttention-4), as the attention backend runs a step of that many tokens
        self.uses_tiles = uses_tiles
        below = [b for b in bucket_sizes if b < max_tokens]
        self.buckets = below + [max_tokens] if max(bucket_sizes) >= max_tokens else below
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0

    @staticmethod
    def max_tiles(bucket_sizes: tuple[int, ...], max_tokens: int, max_seqs: int, group: int) -> int:
        """Length of the tile buffers the buckets need."""
        top = min(max(bucket_sizes), max_tokens)
        return max_attention_tiles(top, max_seqs, group, prefill_block_m(top, group))

    def bucket_for(self, num_tokens: int) -> int | None:
        return _smallest_at_least(self.buckets, num_tokens)

    def block_m(self, bucket: int) -> int:
        return prefill_block_m(bucket, self.group)

    def num_tiles(self, bucket: int) -> int:
        return max_attention_tiles(bucket, self.max_seqs, self.group, self.block_m(bucket))

    def batch_rows(self, bucket: int) -> int:
        return min(bucket, self.max_seqs)

    def meta(self, bucket: int) -> AttentionMetadata:
        b = self.buffers
        seqs = self.batch_rows(bucket)
        tiled = self.uses_tiles(bucket)
        n = self.num_tiles(bucket) if tiled else 0
        return AttentionMetadata(
            slot_mapping=b.slot_mapping[:bucket],
            query_start_loc=b.query_start_loc[: seqs + 1],
            seq_lens=b.seq_lens[:seqs],
            block_tables=b.block_tables[:seqs],
            query_lens_list=[bucket],
            seq_lens_list=[bucket],
            max_query_len=bucket,
            max_seq_len=bucket,
            block_size=self.block_size,
            tiles=(b.attn_tile_seq[:n], b.attn_tile_index[:n], self.block_m(bucket)) if tiled else None,
        )

    @torch.inference_mode()
    def capture(self, pool=None):
        """Capture every bucket into `pool` (a new one when None); returns the pool."""
        b = self.buffers
        b.slot_mapping.fill_(-1)  # the warm-ups and captures write no KV and attend to nothing
        b.attn_tile_seq.fill_(-1)
        b.query_start_loc.zero_()  # (no tile list: every request is empty)
        b.seq_lens.zero_()
        for bucket in reversed(self.buckets):  # largest first, so smaller graphs reuse its pool
            meta = self.meta(bucket)
            self.model(b.input_ids[:bucket], b.positions[:bucket], meta)  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(b.input_ids[:bucket], b.positions[:bucket], meta)
            pool = graph.pool()
            self.graphs[bucket] = (graph, hidden)
        torch.cuda.synchronize()
        return pool

    def replay(self, bucket: int, num_tokens: int) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of the step whose inputs, padded to `bucket`, are in the buffers."""
        graph, hidden = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        return hidden[:num_tokens]
