"""Step inputs in device buffers allocated once, so a step allocates nothing on the device and CUDA graphs can
read the same addresses every replay.

On CUDA the host values go through pinned staging buffers, two sets used in turn (`next_step()`), so a copy is
queued without waiting for the device and the next step is prepared while the one before it still runs. A set is
written again only once the copies out of it have run (an event recorded after them, `staged()`): steps that
sample nothing (prefill chunks) do not wait for the device, and the host could otherwise run two steps ahead and
overwrite values a queued copy has not read yet."""

from __future__ import annotations

import torch


class StepBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 max_tiles: int = 1):
        def buf(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.input_ids = buf(max_tokens)
        self.positions = buf(max_tokens)
        self.slot_mapping = buf(max_tokens)
        self.query_start_loc = buf(max_seqs + 1)
        self.seq_lens = buf(max_seqs)
        self.block_tables = buf(max_seqs, max_blocks_per_seq)
        self.logits_indices = buf(max_seqs)
        # the attention tile list of a step replayed from a token-count graph (see TokenGraphs)
        self.attn_tile_seq = buf(max_tiles)
        self.attn_tile_index = buf(max_tiles)
        # decode steps have one query token per request: their cu_seqlens never change
        self.decode_query_start_loc = torch.arange(max_seqs + 1, dtype=torch.long, device=device)
        names = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                 "logits_indices", "attn_tile_seq", "attn_tile_index")
        self._staging = [
            {n: torch.zeros(getattr(self, n).numel(), dtype=torch.long).pin_memory() for n in names} for _ in range(2)
        ] if device.type == "cuda" else []
        self._turn = 0
        self._copied: list[torch.cuda.Event | None] = [None, None]

    def next_step(self) -> None:
        """Switch staging sets: called once per step, before its `fill` calls."""
        self._turn ^= 1
        if self._staging and self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()  # the step before last has read this set

    def staged(self) -> None:
        """Called after a step's `fill` calls: marks where the copies out of this staging set end."""
        if self._staging:
            if self._copied[self._turn] is None:
                self._copied[self._turn] = torch.cuda.Event()
            self._copied[self._turn].record()

    def _source(self, name: str, values: list) -> torch.Tensor:
        src = torch.tensor(values, dtype=torch.long)
        if not self._staging:
            return src
        # contiguous, so the copy goes straight from pinned memory (a strided source would be packed into pageable)
        stage = self._staging[self._turn][name][: src.numel()].view(src.shape)
        stage.copy_(src)
        return stage

    def fill(self, name: str, values: list[int]) -> torch.Tensor:
        """Copy `values` into the front of buffer `name`; returns that slice."""
        dst = getattr(self, name)[: len(values)]
        dst.copy_(self._source(name, values), non_blocking=True)
        return dst

    def fill_block_tables(self, tables: list[list[int]], width: int) -> torch.Tensor:
        rows = [t + [0] * (width - len(t)) for t in tables]
        if rows:
            self.block_tables[: len(rows), :width].copy_(self._source("block_tables", rows), non_blocking=True)
        return self.block_tables[: len(rows)]

    def pad_decode_rows(self, start: int, end: int) -> None:
        """Rows [start, end) of a padded decode graph: no KV write, one visible key, finite inputs."""
        if end > start:
            self.slot_mapping[start:end].fill_(-1)
            self.seq_lens[start:end].fill_(1)
            self.input_ids[start:end].zero_()
            self.positions[start:end].zero_()
