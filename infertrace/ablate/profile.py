"""A phase's profile, reduced to the waterfall's columns: kernels and launch calls per decode step, GPU idle share.

The steps, their kernels and their GPU busy time come from `infertrace analyze` (inference phases). A CPU-only
trace has no kernels; there the count that stands in for them is the CPU operators per decode step (leaf aten
ops, the ones that would each be a kernel on a GPU). With speculative decoding, verify steps count as decode steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

DECODE = "DECODE"
VERIFY = "VERIFY"  # a decode step with draft tokens verified (speculative decoding): counted with the decode steps


@dataclass(slots=True)
class ProfileFigures:
    trace_dir: str
    has_gpu: bool
    steps: int  # engine steps found in the capture
    decode_steps: int
    kernels_per_decode_step: float | None  # GPU kernels, graph-replayed ones included
    launches_per_decode_step: float | None  # launch calls (cudaLaunchKernel, cudaGraphLaunch, ...)
    attention_kernels_per_decode_step: float | None  # of the kernels, attention's (split-KV merges included)
    cpu_ops_per_decode_step: float | None  # leaf CPU operators
    gpu_idle_share: float | None  # of the captured steps' wall time, the share with no GPU work running
    host_wait_share: float | None  # of the same wall time, the share the GPU sat idle waiting for a launch
    decode_step_p50_ms: float | None
    decode_spacing_p50_ms: float | None  # between decode steps' last kernels: the step rate, also when steps overlap
    verdict: str | None  # analyze's CPU-bound / GPU-bound / mixed for decode steps
    phases: list[dict] = field(default_factory=list)  # analyze's per-step-type summary
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def analyze_profile(trace_dir: str | Path) -> ProfileFigures:
    """Load the capture in `trace_dir` with `infertrace analyze` and reduce it. Raises CaptureError when there is
    no usable trace, ValueError when it holds no engine step."""
    from infertrace.analyze.capture import load_capture
    from infertrace.analyze.events import GPU_WORK
    from infertrace.analyze.phases import find_steps, phase_summary, step_metrics

    capture = load_capture(trace_dir)
    if len(capture.ranks) != 1:
        capture.problems.append(f"{len(capture.ranks)} trace files; the first one is used")
    events = capture.ranks[0].events
    found = find_steps(events)
    if found.empty:
        raise ValueError(f"no engine step annotations in the capture at {trace_dir}")
    steps = step_metrics(events, found)
    has_gpu = bool(events["kind"].isin(GPU_WORK).any())
    summary = phase_summary(steps, has_gpu)
    decode = steps["type"].isin((DECODE, VERIFY)).to_numpy()
    n_decode = int(decode.sum())

    def per_decode(counts: np.ndarray) -> float | None:
        return float(counts[decode].mean()) if n_decode else None

    kernels = launches_per_step = attention = idle = host_wait = verdict = None
    if has_gpu:
        kernels = per_decode(steps["kernels"].to_numpy())
        launches_per_step = per_decode(steps["launches"].to_numpy())
        attention = per_decode(steps["attention kernels"].to_numpy())
        wall = float(steps["step_ms"].sum())
        if wall > 0:
            idle = 1.0 - float(steps["busy_ms"].sum()) / wall
            host_wait = float(steps["host_wait_ms"].sum()) / wall
        row = summary[summary["type"] == DECODE]
        verdict = str(row["verdict"].iloc[0]) if not row.empty else None
    ops = events[(events["kind"] == "cpu_op").to_numpy()]
    cpu_ops = per_decode(count_in_steps(leaf_ops(ops), steps)) if not ops.empty else None
    step_ms = steps.loc[decode, "step_ms"].to_numpy()
    spacing = steps.loc[decode, "spacing_ms"].to_numpy()
    spacing = spacing[~np.isnan(spacing)]
    return ProfileFigures(
        trace_dir=str(trace_dir), has_gpu=has_gpu, steps=len(steps), decode_steps=n_decode,
        kernels_per_decode_step=kernels, launches_per_decode_step=launches_per_step,
        attention_kernels_per_decode_step=attention,
        cpu_ops_per_decode_step=cpu_ops, gpu_idle_share=idle, host_wait_share=host_wait,
        decode_step_p50_ms=float(np.median(step_ms)) if n_decode else None,
        decode_spacing_p50_ms=float(np.median(spacing)) if spacing.size else None, verdict=verdict,
        phases=_records(summary), problems=list(capture.problems))


def leaf_ops(ops: pd.DataFrame) -> pd.DataFrame:
    """The operators that call no other operator on their thread (an op's children start before it ends)."""
    order = ops.sort_values(["pid", "tid", "ts_ns", "dur_ns"], ascending=[True, True, True, False], kind="stable")
    end = (order["ts_ns"] + order["dur_ns"]).to_numpy()
    same = (order["pid"].shift(-1) == order["pid"]).to_numpy() & (order["tid"].shift(-1) == order["tid"]).to_numpy()
    has_child = same & (order["ts_ns"].shift(-1).to_numpy() < end)
    return order[~has_child]


def count_in_steps(points: pd.DataFrame, steps: pd.DataFrame) -> np.ndarray:
    """How many of `points` (ts_ns, pid, tid) fall inside each step's range on the step's thread."""
    counts = np.zeros(len(steps), dtype=np.int64)
    if points.empty or steps.empty:
        return counts
    left = pd.DataFrame({"ts_ns": points["ts_ns"].to_numpy(), "pid": points["pid"].to_numpy(),
                         "tid": points["tid"].to_numpy()}).sort_values("ts_ns", kind="stable")
    right = pd.DataFrame({"ts_ns": steps["ts_ns"].to_numpy(), "pid": steps["pid"].to_numpy(),
                          "tid": steps["tid"].to_numpy(), "end_ns": steps["end_ns"].to_numpy(),
                          "step": np.arange(len(steps), dtype=np.float64)}).sort_values("ts_ns", kind="stable")
    matched = pd.merge_asof(left, right, on="ts_ns", by=["pid", "tid"], direction="backward")
    inside = (matched["ts_ns"] < matched["end_ns"]).to_numpy()
    np.add.at(counts, matched["step"].to_numpy()[inside].astype(np.int64), 1)
    return counts


def _records(frame: pd.DataFrame) -> list[dict]:
    out = []
    for row in frame.to_dict("records"):
        out.append({k: (None if isinstance(v, float) and np.isnan(v) else v.item() if hasattr(v, "item") else v)
                    for k, v in row.items()})
    return out
