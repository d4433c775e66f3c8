"""Programmatic dependent launch (PDL) of the engine's Triton kernels, on Hopper (sm_90) and later.

A kernel launched with PDL may start while the kernel before it in the stream still runs: its programs become
resident once every program of that kernel has called `gdc_launch_dependents`, and block in `gdc_wait` until it has
finished and its writes are visible. Every kernel here calls `gdc_wait` first, before it reads or writes any
memory, so what overlaps the kernel before is only the launch and the programs' start: about a microsecond a kernel,
which adds up over the few hundred small kernels of a decode step. (Prefetching a GEMM's first weights into L2 before
the wait measured no faster on an H100, so the kernels do not.)

The switch is process-wide (`EngineConfig.pdl`, set by the model runner); a CUDA graph keeps the launches as they
were when it was captured.
"""

from __future__ import annotations

import torch

_enabled = False
_early = 1


def set_enabled(on: bool) -> bool:
    """Turn PDL on where the current device has it (compute capability 9.0 and later); returns whether it is on."""
    global _enabled
    _enabled = bool(on) and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    return _enabled


def enabled() -> bool:
    return _enabled



def set_early(level: int) -> None:
    """What decode attention does before its wait (with PDL): 0 nothing, 1 reads its step inputs, 2 also asks L2 for
    its first K/V lines."""
    global _early
    _early = int(level)


def early() -> int:
    return _early
