"""Greedy sampling's argmax over the vocabulary, in two small kernels: each program takes the maximum of a chunk of
a row, then one program a row picks among the chunks.

A decode step's logits are a few rows of 150k values. A reduction over so few rows gives the GPU little to spread
(torch.argmax: about 10 us for 8 rows of qwen3's vocabulary on an H100); chunks of every row at once fill it. Ties go
to the first index, as torch.argmax's do. Logits are expected finite (a NaN is not taken as the maximum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from infertrace.engine.kernels import launch

CHUNK = 4096


@triton.jit
def _chunk_max_kernel(logits_ptr, values_ptr, index_ptr, vocab, stride_row, chunks, CHUNK: tl.constexpr,
                      PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    value, index = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(values_ptr + row * chunks + chunk, value)
    tl.store(index_ptr + row * chunks + chunk, chunk * CHUNK + index)
    if PDL:  # the pick's programs may become resident and wait
        gdc_launch_dependents()


@triton.jit
def _pick_kernel(values_ptr, index_ptr, out_ptr, chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PDL:
        gdc_wait()
    i = tl.arange(0, BLOCK)
    values = tl.load(values_ptr + row * chunks + i, mask=i < chunks, other=float("-inf"))
    _, best = tl.max(values, 0, return_indices=True, return_indices_tie_break_left=True)  # the first chunk on a tie
    tl.store(out_ptr + row, tl.load(index_ptr + row * chunks + best).to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (any float dtype, last dim contiguous) -> int64 [B]: the first index of each row's maximum."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    values = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    index = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    _chunk_max_kernel[(rows, chunks)](logits, values, index, vocab, logits.stride(0), chunks, CHUNK=CHUNK,
                                      PDL=launch.enabled(), num_warps=4)
    _pick_kernel[(rows,)](values, index, out, chunks, BLOCK=triton.next_power_of_2(chunks), PDL=launch.enabled(),
                          num_warps=1, launch_pdl=launch.enabled())
    return out
