"""Bring a weight into L2 while other kernels run: the decode step's output projection, asked for while attention
reads the KV cache.

At a small decode batch attention leaves most of the memory's bandwidth unused (a batch-8 qwen3-4b layer reads 12.6
MB of K/V in about 10 us), and the weight-streaming GEMM after it loses time at its start and end. A kernel that
only issues L2 prefetches for the next projection's weights, placed in the stream before attention, fills that
bandwidth: the projection then reads its weights from L2.

With programmatic dependent launch (`launch.py`) its programs start while the kernel before still runs: they ask
for their lines, let the next kernel launch, then wait for the kernel before to finish, so that a kernel after this
one that waits on it waits on everything before it too. Prefetches change no value anywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from infertrace.engine.kernels import launch

LINE = 128  # bytes of an L2 line
LINES_PER_PROGRAM = 1024

# experiment switches (step_graphs_bench --only prefetch): how many bytes of the weight, and the L2 policy
_fraction = 1.0
_evict_last = False
_where = "attention"  # or "norm": before the q/k norm kernel, or "off"


def configure(fraction: float | None = None, evict_last: bool | None = None, where: str | None = None) -> None:
    global _fraction, _evict_last, _where
    if fraction is not None:
        _fraction = float(fraction)
    if evict_last is not None:
        _evict_last = bool(evict_last)
    if where is not None:
        _where = where


def where() -> str:
    return _where


@triton.jit
def _l2_prefetch_kernel(ptr, n_lines, LINE_ELEMS: tl.constexpr, LINES: tl.constexpr, EVICT_LAST: tl.constexpr,
                        PDL: tl.constexpr):
    lines = tl.minimum(tl.program_id(0) * LINES + tl.arange(0, LINES), n_lines - 1)
    addrs = ptr + lines.to(tl.int64) * LINE_ELEMS
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; // $0 unused", "=r,l", [addrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0 unused", "=r,l", [addrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    if PDL:  # the next kernel may start now; this one ends only after the kernel before it has
        gdc_launch_dependents()
        gdc_wait()


def l2_prefetch(t: torch.Tensor) -> None:
    """Ask L2 for the first `_fraction` of a contiguous CUDA tensor's bytes (its lines, from its start)."""
    if _fraction <= 0:
        return
    assert t.is_cuda and t.is_contiguous() and LINE % t.element_size() == 0
    n_lines = max(1, int(t.numel() * t.element_size() * min(_fraction, 1.0)) // LINE)
    grid = (triton.cdiv(n_lines, LINES_PER_PROGRAM),)
    _l2_prefetch_kernel[grid](t, n_lines, LINE_ELEMS=LINE // t.element_size(), LINES=LINES_PER_PROGRAM,
                              EVICT_LAST=_evict_last, PDL=launch.enabled(), num_warps=4,
                              launch_pdl=launch.enabled())
