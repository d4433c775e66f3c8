"""Step inputs in device buffers allocated once, so a step allocates nothing on the device and CUDA graphs can
read the same addresses every replay."""

from __future__ import annotations

import torch


class StepBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device):
        def buf(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.input_ids = buf(max_tokens)
        self.positions = buf(max_tokens)
        self.slot_mapping = buf(max_tokens)
        self.query_start_loc = buf(max_seqs + 1)
        self.seq_lens = buf(max_seqs)
        self.block_tables = buf(max_seqs, max_blocks_per_seq)
        self.logits_indices = buf(max_seqs)
        # decode steps have one query token per request: their cu_seqlens never change
        self.decode_query_start_loc = torch.arange(max_seqs + 1, dtype=torch.long, device=device)

    def fill(self, name: str, values: list[int]) -> torch.Tensor:
        """Copy `values` into the front of buffer `name`; returns that slice."""
        dst = getattr(self, name)[: len(values)]
        dst.copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)
        return dst

    def fill_block_tables(self, tables: list[list[int]], width: int) -> torch.Tensor:
        rows = [t + [0] * (width - len(t)) for t in tables]
        self.block_tables[: len(rows), :width].copy_(torch.tensor(rows, dtype=torch.long), non_blocking=True)
        return self.block_tables[: len(rows)]

    def pad_decode_rows(self, start: int, end: int) -> None:
        """Rows [start, end) of a padded decode graph: no KV write, one visible key, finite inputs."""
        if end > start:
            self.slot_mapping[start:end].fill_(-1)
            self.seq_lens[start:end].fill_(1)
            self.input_ids[start:end].zero_()
            self.positions[start:end].zero_()
