"""CUDA graphs for decode: one graph per batch-size bucket, captured at start-up into one memory pool.

A decode step of B requests replays the graph of the smallest bucket >= B with the extra rows padded (they write no
KV and attend to one key); batches above the largest bucket, prefills and mixed steps run eagerly.
"""

from __future__ import annotations

import bisect

import torch

from infertrace.engine.attention import AttentionMetadata
from infertrace.engine.step_buffers import StepBuffers


class DecodeGraphs:
    def __init__(self, model, buffers: StepBuffers, bucket_sizes: tuple[int, ...], max_seqs: int, block_size: int):
        self.model = model
        self.buffers = buffers
        self.block_size = block_size
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
        )

    @torch.inference_mode()
    def capture(self) -> None:
        b = self.buffers
        b.pad_decode_rows(0, b.seq_lens.numel())
        pool = None
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

    def bucket_for(self, batch_size: int) -> int | None:
        i = bisect.bisect_left(self.buckets, batch_size)
        return self.buckets[i] if i < len(self.buckets) else None

    def replay(self, batch_size: int) -> torch.Tensor:
        """Logits [batch_size, vocab] of the decode step whose inputs are in the buffers' first rows."""
        bucket = self.bucket_for(batch_size)
        self.buffers.pad_decode_rows(batch_size, bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:batch_size]
