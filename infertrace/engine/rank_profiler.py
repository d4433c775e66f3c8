"""torch.profiler over one rank's steps, written as one Kineto trace per rank.

torch.profiler records the operators of the thread that starts it, so each rank starts its own in the thread that
runs its steps. With torch.distributed initialised (tensor parallelism) the profiler writes `distributedInfo`
(rank, world size, backend) into the trace by itself.
"""

from __future__ import annotations

from pathlib import Path

TRACE_SUFFIX = ".pt.trace.json.gz"


def trace_path(out_dir: str | Path, stem: str, rank: int) -> Path:
    """`{stem}.rank{rank}.pt.trace.json.gz` in `out_dir`: the ranks of one capture share `stem`."""
    return Path(out_dir) / f"{stem}.rank{rank}{TRACE_SUFFIX}"


class RankProfiler:
    def __init__(self, out_dir: str | Path, stem: str, rank: int, activities: tuple[str, ...] = ("CPU", "GPU"),
                 record_shapes: bool = False, with_stack: bool = False):
        import torch

        kinds = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA}
        unknown = [a for a in activities if a.upper() not in kinds]
        if unknown:
            raise ValueError(f"unknown profiler activity {unknown[0]!r}; choose from CPU, GPU")
        chosen = [kinds[a.upper()] for a in activities if a.upper() == "CPU" or torch.cuda.is_available()]
        self.path = trace_path(out_dir, stem, rank)
        self._profiler = torch.profiler.profile(activities=chosen or [kinds["CPU"]], record_shapes=record_shapes,
                                                with_stack=with_stack)

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._profiler.start()

    def stop(self) -> str:
        """Stop and write the trace; its path."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()  # kernels still in flight would be missing from the trace
        self._profiler.stop()
        self._profiler.export_chrome_trace(str(self.path))  # a .gz name makes torch gzip it
        return str(self.path)
