"""All-gather of a decode step's vocabulary-parallel logits over NVLink peer memory, one kernel on every rank.

Each rank holds the logits of its shard of the vocabulary, [T, shard] in a 16-bit dtype; every rank needs all of
them, [T, ranks x shard], to sample. NCCL's all-gather costs tens of microseconds a step at these sizes (25 us a
qwen3-14b step at TP=2, its output then copied once more by `torch.cat`). Here each program takes CHUNK columns of
one row: it *pushes* them into slot s of every rank's buffer, at its rank's place, with plain stores, then reads its
own buffer's entries of those columns for every rank, again until none is still empty, and writes them to the
output in rank order. No program waits on another of its rank, so every program of the grid works at once.

The protocol is the all-reduce + norm kernel's (kernels/allreduce_norm.py): an empty entry holds -0.0 (the bits
0x8000), which no pushed value is (a -0.0 is pushed as +0.0: the logit's sign of zero, nothing a sampler reads);
three slots take turns, call k using slot k mod 3 and emptying slot k-1 mod 3, which every rank had read by the end
of call k-1. The calls are counted by a counter on the device that each call moves on before its kernel (both
captured in the CUDA graphs), so every rank numbers its calls alike as long as the ranks gather the same steps. The
emptying covers the rows the previous call pushed, which the kernel notes beside the slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from infertrace.engine.kernels import launch
from infertrace.engine.kernels.allreduce_norm import (
    EMPTY_HALF,
    EMPTY_HALF_BITS,
    MAX_ROWS,
    SLOTS,
    empty_rows,
    push_to_ranks,
    wait_filled,
)

CHUNK = 2048  # the columns of a row one program pushes and pulls


@triton.jit
def _allgather_kernel(x_ptr, buffers_ptr, count_ptr, rows_ptr, out_ptr, n_rows, n_cols, stride_out,
                      RANK: tl.constexpr, WORLD: tl.constexpr, MAX_ROWS: tl.constexpr, CHUNK: tl.constexpr,
                      PDL: tl.constexpr):
    part = tl.program_id(0)
    row = tl.program_id(1)
    cols = part * CHUNK + tl.arange(0, CHUNK)
    mask = cols < n_cols
    if PDL:  # the logits (and the counter) come from the kernels before
        gdc_wait()
        gdc_launch_dependents()
    k = tl.load(count_ptr)
    slot = k % 3
    previous = (k + 2) % 3
    slot_size = WORLD * MAX_ROWS * n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    # this rank's columns of the row into every rank's buffer
    push_to_ranks(x, slot * slot_size + (RANK * MAX_ROWS + row) * n_cols + cols, mask, buffers_ptr, x.dtype, WORLD,
                  False)
    own = tl.multiple_of(tl.load(buffers_ptr + RANK).to(tl.pointer_type(tl.int16)), 16)
    for r in tl.static_range(WORLD):  # every rank's columns, as they land, to the output in rank order
        bits = wait_filled(own + slot * slot_size + (r * MAX_ROWS + row) * n_cols + cols, mask, EMPTY_HALF)
        tl.store(out_ptr + row * stride_out + r * n_cols + cols, bits.to(x.dtype, bitcast=True), mask=mask)
    # empty these columns of the previous call's rows in the previous slot (every rank pushed the same rows)
    empty_rows(own + previous * slot_size, row, n_rows, tl.load(rows_ptr + previous), cols, mask, n_cols, EMPTY_HALF,
               CHUNK, WORLD, MAX_ROWS)
    if (part == 0) & (row == 0):  # the rows this call pushed, for the call that empties its slot
        tl.store(rows_ptr + slot, n_rows)


class GatherBuffers:
    """This rank's slots ([3, world, MAX_ROWS, cols] of a 16-bit dtype, every entry empty at first) in symmetric
    memory, the addresses of every rank's, the call counter and each slot's rows. Built on every rank at once (a
    collective)."""

    def __init__(self, device: torch.device, world_size: int, cols: int, dtype: torch.dtype, group_name: str):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        assert dtype.itemsize == 2, "the entries are 16-bit"
        self.world_size = world_size
        self.cols = cols
        self.dtype = dtype
        self.buffer = symm_mem.empty(SLOTS * world_size * MAX_ROWS * cols, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(self.buffer, group_name)
        self.rank = handle.rank
        self.buffer.view(torch.int16).fill_(EMPTY_HALF_BITS)
        self.addresses = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        self.rows = torch.zeros(SLOTS, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        dist.barrier()  # every rank's slots are empty before any rank pushes

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` ([rows, cols] of the buffers' dtype, at most MAX_ROWS rows, contiguous) can be gathered here."""
        return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.shape[1] == self.cols and x.dtype == self.dtype
                and x.is_contiguous())

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension, [rows, world x cols], on every rank."""
        rows = x.shape[0]
        out = torch.empty((rows, self.world_size * self.cols), dtype=x.dtype, device=x.device)
        self.count.add_(1)
        if rows:
            _allgather_kernel[(triton.cdiv(self.cols, CHUNK), rows)](
                x, self.addresses, self.count, self.rows, out, rows, self.cols, out.stride(0),
                RANK=self.rank, WORLD=self.world_size, MAX_ROWS=MAX_ROWS, CHUNK=CHUNK, PDL=launch.enabled(),
                num_warps=4, launch_pdl=launch.enabled(),
            )
        return out
