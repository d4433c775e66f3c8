"""The engine's one rule for torch's CPU threads, applied wherever an engine runs on the CPU: `infertrace serve`'s
engine process and the bundled engine bench runs in its own process."""

from __future__ import annotations

import os


def cpu_threads() -> int:
    """Set torch's intra-op threads for an engine on the CPU to one core fewer than the host has (at least one), so
    the event loop and the engine's own Python thread keep a core; returns the count in use. With every core in a
    GEMM, a thread descheduled by them (or by any other process) holds the others spinning at OpenMP's barrier. On
    a shared 2-core host (load average about 7), `bench --concurrency 8 --num-prompts 16` took 22.9-36.3 s (median
    of 4: 34.2) and 9.1-11.5 s of CPU with two threads, 23.0-27.7 s (median 24.4) and 8.7-9.3 s with one. An
    OMP_NUM_THREADS the user set is kept."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    return torch.get_num_threads()
