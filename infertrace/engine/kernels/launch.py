"""Programmatic dependent launch (PDL) of the engine's Triton kernels, on Hopper (sm_90) and later.

A kernel launched with PDL may start while the kernel before it in the stream still runs: its programs become
resident once every program of that kernel has called `gdc_launch_dependents`, and block in `gdc_wait` until it has
finished and its writes are visible. What overlaps the kernel before is the launch, the programs' start, and whatever
a kernel reads before its wait: only what no kernel of the step writes, the step's host inputs (positions, context
lengths, block tables, launch order, copied in before the graph or step starts) and constants (norm weights, RoPE
tables). The RMSNorm kernels (their weight), the q/k-norm kernel, decode attention and the split merge read theirs
there; the GEMMs and SiLU-and-multiply wait first. About a microsecond a kernel, which adds up over the few hundred
small kernels of a decode step. (Asking L2 for a GEMM's first weights, or decode attention's first K/V lines, before
the wait measured slower or no faster on an H100, so the kernels do not. With more than one rank the decode GEMMs
take a Gluon kernel that copies its first tiles of weights into shared memory before its wait, while the all-reduce
before it waits on the other ranks: `skinny_gemm(..., early=True)`, `skinny_gemm.early_rule`.)

A kernel must not end before the kernel before it: the next kernel's wait is a wait on this one, and the engine does
not rely on it reaching further back. So in every kernel some program waits whatever the step's inputs are (decode
attention's first split always does, the split merge's programs all do, even those with nothing to merge), and no
program returns early in a way that could leave none waiting.

The switch is process-wide (`EngineConfig.pdl`, set by the model runner); a CUDA graph keeps the launches as they
were when it was captured.
"""

from __future__ import annotations

import torch

_enabled = False


def set_enabled(on: bool) -> bool:
    """Turn PDL on where the current device has it (compute capability 9.0 and later); returns whether it is on."""
    global _enabled
    _enabled = bool(on) and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    return _enabled


def enabled() -> bool:
    return _enabled
