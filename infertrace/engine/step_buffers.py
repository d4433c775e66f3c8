"""Step inputs in device buffers allocated once, so a step allocates nothing on the device and CUDA graphs can
read the same addresses every replay.

Every buffer is a view of one flat device tensor. On CUDA a step's values go there in one batch: `put` writes them
into a pinned staging buffer (numpy views, no tensor per field) with, beside them, where each value goes in the
flat tensor; `commit` queues one host-to-device copy of the used part of the staging buffer and one `index_copy_`
that scatters the values into place. Two staging buffers are used in turn (`begin`), so the next step is prepared
while the one before it still runs; a staging buffer is written again only once the copy out of it has run (an
event recorded after it): steps that sample nothing (prefill chunks) do not wait for the device, and the host could
otherwise run two steps ahead and overwrite values a queued copy has not read yet. Elsewhere `put` copies at once."""

from __future__ import annotations

import math

import numpy as np
import torch

_MAX_VIEWS = 4096  # kept destination views (name, start, rows, width); all are dropped when this many are kept


class StepBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 max_tiles: int = 1):
        shapes = {
            "input_ids": (max_tokens,),
            "positions": (max_tokens,),
            "slot_mapping": (max_tokens,),
            "query_start_loc": (max_seqs + 1,),
            "seq_lens": (max_seqs,),
            "block_tables": (max_seqs, max_blocks_per_seq),
            "logits_indices": (max_tokens,),  # a verify step's rows take logits at every draft's position
            "decode_order": (max_seqs,),  # a decode step's rows, longest context first (`decode_order`)
            # the attention tile list of a step replayed from a token-count graph (see TokenGraphs)
            "attn_tile_seq": (max_tiles,),
            "attn_tile_index": (max_tiles,),
            # async scheduling: rows of this step's input ids taken from the previous step's sampled tokens
            "feed_rows": (max_seqs,),
            "feed_sources": (max_seqs,),
        }
        total = sum(math.prod(shape) for shape in shapes.values())
        self.flat = torch.zeros(total, dtype=torch.long, device=device)
        self._offset: dict[str, int] = {}
        offset = 0
        for name, shape in shapes.items():
            size = math.prod(shape)
            setattr(self, name, self.flat[offset : offset + size].view(shape))
            self._offset[name] = offset
            offset += size
        # decode steps have one query token per request: their cu_seqlens never change
        self.decode_query_start_loc = torch.arange(max_seqs + 1, dtype=torch.long, device=device)
        self.decode_order.copy_(self.decode_query_start_loc[:max_seqs])  # a permutation before any step sets one

        self._staged = device.type == "cuda"
        if self._staged:
            # values first, then (moved there by commit) the flat index of each: one contiguous copy
            self._staging = [torch.zeros(2 * total, dtype=torch.long).pin_memory() for _ in range(2)]
            self._staging_np = [s.numpy() for s in self._staging]
            self._index = np.zeros(total, dtype=np.int64)
            self._iota = np.arange(total, dtype=np.int64)  # flat index of every element, sliced by `put`
            self._packed = torch.zeros(2 * total, dtype=torch.long, device=device)
            self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._count = 0  # values put since `begin`
        self._views: dict[tuple[str, int, int, int | None], torch.Tensor] = {}  # `put`'s destination views, kept

    def begin(self) -> None:
        """Start a step's `put` calls in the other staging buffer (waiting until the copy out of it has run)."""
        self._turn ^= 1
        self._count = 0
        if self._staged and self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()  # the step before last has read this buffer

    def put(self, name: str, values: np.ndarray, start: int = 0) -> torch.Tensor:
        """Write `values` into buffer `name` from row `start` on (a 2-D array fills the top-left corner of
        `block_tables`); returns the device view they land in, valid in stream order once `commit` has run."""
        buffer = getattr(self, name)
        rows = len(values)
        width = values.shape[1] if values.ndim == 2 else None
        key = (name, start, rows, width)
        dst = self._views.get(key)
        if dst is None:  # a view costs microseconds of host time a step; the same few recur step after step
            dst = buffer[start : start + rows]
            if width is not None:
                dst = dst[:, :width]
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            self._views[key] = dst
        if not self._staged:
            dst.copy_(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)))
            return dst
        n, count = values.size, self._count
        self._staging_np[self._turn][count : count + n] = values.reshape(-1)
        base = self._offset[name] + start * buffer.stride(0)
        if width is not None:
            stride = buffer.stride(0)
            self._index[count : count + n].reshape(rows, width)[:] = \
                self._iota[base : base + rows * stride].reshape(rows, stride)[:, :width]
        else:
            self._index[count : count + n] = self._iota[base : base + n]
        self._count = count + n
        return dst

    def commit(self) -> None:
        """After a step's `put` calls: one copy of the staged values and their index, and one scatter into place."""
        n = self._count
        if not self._staged or n == 0:
            return
        stage = self._staging_np[self._turn]
        stage[n : 2 * n] = self._index[:n]
        packed = self._packed[: 2 * n]
        packed.copy_(self._staging[self._turn][: 2 * n], non_blocking=True)
        if self._copied[self._turn] is None:
            self._copied[self._turn] = torch.cuda.Event()
        self._copied[self._turn].record()
        self.flat.index_copy_(0, packed[n:], packed[:n])

    def pad_decode_rows(self, start: int, end: int) -> None:
        """Rows [start, end) of a padded decode graph: no KV write, one visible key, finite inputs."""
        if end > start:
            self.slot_mapping[start:end].fill_(-1)
            self.seq_lens[start:end].fill_(1)
            self.input_ids[start:end].zero_()
            self.positions[start:end].zero_()

    def put_decode_padding(self, start: int, end: int) -> None:
        """`pad_decode_rows` as staged values, part of the step's one copy."""
        if end > start:
            pad = end - start
            self.put("slot_mapping", np.full(pad, -1, dtype=np.int64), start)
            self.put("seq_lens", np.ones(pad, dtype=np.int64), start)
            self.put("input_ids", np.zeros(pad, dtype=np.int64), start)
            self.put("positions", np.zeros(pad, dtype=np.int64), start)
