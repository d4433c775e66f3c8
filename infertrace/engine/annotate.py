"""Profiler ranges that show up under the same name in torch.profiler traces and in NVTX (Nsight Systems)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def _nvtx_pair() -> tuple[Callable[[str], object], Callable[[], object]] | None:
    if torch.cuda.is_available():
        return torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    try:
        import nvtx
    except ImportError:
        return None
    return nvtx.push_range, nvtx.pop_range


_NVTX = _nvtx_pair()


_profiling = torch._C._autograd._profiler_enabled  # whether torch.profiler records this thread now


class _Range:
    __slots__ = ("name", "record")

    def __init__(self, name: str) -> None:
        self.name = name
        self.record = None

    def __enter__(self) -> None:
        if _NVTX is not None:
            _NVTX[0](self.name)
        if _profiling():
            self.record = torch.profiler.record_function(self.name)
            self.record.__enter__()

    def __exit__(self, *exc) -> None:
        try:
            if self.record is not None:
                self.record.__exit__(*exc)
        finally:
            if _NVTX is not None:
                _NVTX[1]()


def annotate(name: str) -> _Range:
    """A range named `name` for torch.profiler (record_function) and NVTX, when a tool is listening. The torch.profiler
    record is made only while a profiler records this thread (it records no other thread's ranges): a range costs
    about 7 us of host time otherwise, and a step opens five or more."""
    return _Range(name)


def step_range_name(kind: str, batch_size: int, num_tokens: int, number: int | None = None) -> str:
    """`step[PREFILL bs=2 toks=300 #41]`, `step[DECODE bs=16 #42]`, `step[MIXED bs=9 toks=72 #43]`: `#N` is the
    engine's step number, the one its request log gives each step (GET /v1/request_log), so a capture's steps
    can be joined to the requests that rode them."""
    tail = "" if number is None else f" #{number}"
    if kind == "decode":
        return f"step[DECODE bs={batch_size}{tail}]"
    return f"step[{kind.upper()} bs={batch_size} toks={num_tokens}{tail}]"
