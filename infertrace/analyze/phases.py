"""Inference phases: engine steps found from their profiler annotations, and the GPU work each step launched.

Recognised step annotations (CPU ranges, torch.profiler `record_function` or NVTX):
- infertrace's engine: `step[PREFILL bs=2 toks=300]`, `step[DECODE bs=16]`, `step[MIXED bs=9 toks=72]`
- SGLang: `step[EXTEND bs=15 toks=15360]`, `step[DECODE bs=..]` (and its other modes)
- vLLM: `execute_context_1(888_788544)_generation_0(0)`: 1 prefill request of 888 tokens, no decodes
  (`execute_<tokens>_context_..(sq..sk..)` with `detailed_trace_annotation`): vllm/v1/worker/gpu_worker.py
  `annotate_profile` in vLLM 0.33.0, around each `execute_model`, for the GPU and CPU workers alike; the model
  runner's `gpu_model_runner: forward` (and preprocess, sample, ...) ranges inside it are not steps
- otherwise `ProfilerStep#N`, as generic steps.
A recognised range that encloses another on the same thread is a wrapper and is dropped; the innermost counts.

A step's kernels are the GPU work whose correlation id matches a launch call (cudaLaunchKernel, cudaGraphLaunch,
hipLaunchKernel, ...) made inside the step's range on the step's thread (or, when the call's thread id is stale,
that of no CPU operator, in the same process while the step's range is open). A step's time runs from its start to
its end or to the end of its last kernel, whichever is later (`cpu_ms` is the annotated range alone). Within
that window the GPU is busy (any kernel of the rank runs), waits for the host (idle until a kernel the CPU had
not yet launched when the GPU went idle), or is otherwise idle (waiting on a dependency, a sync, or launch
latency).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from infertrace.analyze.categories import CATEGORIES
from infertrace.analyze.events import GPU_COLUMNS, GPU_WORK, LAUNCH_COLUMNS, rows_of
from infertrace.analyze.intervals import covered_between, union
from infertrace.analyze.kernels import category, per_event

_BRACKET = re.compile(r"^step\[([A-Za-z_]+)\b([^\]]*)\]")
_VLLM = re.compile(r"^execute_(?:\d+_)?context_(\d+)\(([^)]*)\)_generation_(\d+)\(([^)]*)\)")
_PROFILER_STEP = re.compile(r"^ProfilerStep#\d+$")
_FIRST_INT = re.compile(r"\d+")
_PARAM = re.compile(r"\b(bs|toks)=(\d+)")
GPU_BOUND_SHARE = 0.8


@dataclass(frozen=True, slots=True)
class StepLabel:
    type: str
    bs: int | None
    toks: int | None


def parse_step_name(name: str) -> StepLabel | None:
    """The step type, batch size and token count an annotation names, or None when it names no step."""
    if m := _BRACKET.match(name):
        params = dict(_PARAM.findall(m.group(2)))
        return StepLabel(m.group(1).upper(), _int(params.get("bs")), _int(params.get("toks")))
    if m := _VLLM.match(name):
        ctx, gen = int(m.group(1)), int(m.group(3))
        kind = "MIXED" if ctx and gen else "PREFILL" if ctx else "DECODE" if gen else "IDLE"
        toks = sum(int(f.group(0)) for g in (m.group(2), m.group(4)) if (f := _FIRST_INT.search(g)))
        return StepLabel(kind, ctx + gen, toks)
    return None


def _int(text: str | None) -> int | None:
    return int(text) if text is not None else None


def find_steps(events: pd.DataFrame) -> pd.DataFrame:
    """The innermost step annotations of one rank, in time order."""
    ann = events[(events["kind"] == "annotation").to_numpy()]
    names = ann["name"].cat.categories
    labels = {code: parse_step_name(n) for code, n in enumerate(names)}
    codes = ann["name"].cat.codes.to_numpy()
    is_step = np.array([labels[c] is not None for c in codes], dtype=bool)
    if not is_step.any():
        generic = np.array([bool(_PROFILER_STEP.match(names[c])) for c in codes], dtype=bool)
        labels = {c: StepLabel("ProfilerStep", None, None) for c in range(len(names))}
        is_step = generic
    rows = ann[is_step]
    chosen = [labels[c] for c in codes[is_step]]
    steps = pd.DataFrame({
        "type": [s.type for s in chosen], "label": rows["name"].astype(str).to_numpy(),
        "bs": pd.array([s.bs for s in chosen], dtype="Int64"),
        "toks": pd.array([s.toks for s in chosen], dtype="Int64"),
        "pid": rows["pid"].to_numpy(), "tid": rows["tid"].to_numpy(),
        "ts_ns": rows["ts_ns"].to_numpy(), "end_ns": (rows["ts_ns"] + rows["dur_ns"]).to_numpy(),
    })
    steps = steps.sort_values(["pid", "tid", "ts_ns", "end_ns"], ascending=[True, True, True, False],
                              ignore_index=True, kind="stable")
    same_thread = (steps["pid"].shift(-1) == steps["pid"]) & (steps["tid"].shift(-1) == steps["tid"])
    next_ts = steps["ts_ns"].shift(-1, fill_value=np.iinfo(np.int64).max)  # int64: a float loses nanoseconds
    encloses = same_thread & (next_ts < steps["end_ns"])
    steps = steps[~encloses.to_numpy()].sort_values("ts_ns", ignore_index=True, kind="stable")
    return steps


def step_metrics(events: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """`steps` with each step's kernels, GPU busy and host-wait time, and GPU time by kernel category."""
    out = steps.copy()
    out["cpu_ms"] = (out["end_ns"] - out["ts_ns"]) / 1e6
    gpu = rows_of(events, events["kind"].isin(GPU_WORK).to_numpy(), GPU_COLUMNS)
    runtime = rows_of(events, (events["kind"] == "runtime").to_numpy() & (events["correlation"] >= 0).to_numpy(),
                      LAUNCH_COLUMNS)
    runtime = runtime.drop_duplicates("correlation", keep="first")
    launch_ts = pd.Series(runtime["ts_ns"].to_numpy(), index=runtime["correlation"].to_numpy())
    own, step_ids = _ops_in_steps(gpu, _launches_in_steps(runtime, out, _cpu_threads(events)))
    del runtime  # what is left of it is in launch_ts: each temporary goes as soon as it is used (the peak)
    g_end = (gpu["ts_ns"] + gpu["dur_ns"]).to_numpy()
    n = len(out)
    out["kernels"] = np.bincount(step_ids, weights=(gpu["kind"] == "kernel").to_numpy()[own],
                                 minlength=n).astype(np.int64)
    out["gpu_ops"] = np.bincount(step_ids, minlength=n).astype(np.int64)
    # launch calls that reached the GPU: one per correlation id (a graph launch starts many kernels)
    _, first = np.unique(gpu["correlation"].to_numpy()[own], return_index=True)
    out["launches"] = np.bincount(step_ids[first], minlength=n).astype(np.int64)
    del first
    last_end = np.full(n, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(last_end, step_ids, g_end[own])
    wall_end = np.maximum(out["end_ns"].to_numpy(), last_end)
    # the time between this step's last kernel and the previous step's (same process): the rate steps complete
    # at, which stays right when a step is queued before the one ahead of it ends (async scheduling), where the
    # step's own wall time also spans the tail of the step ahead
    has_work = last_end > np.iinfo(np.int64).min
    spacing = np.full(n, np.nan)
    for _, idx in out.groupby("pid", sort=False).indices.items():
        idx = np.sort(idx)
        idx = idx[has_work[idx]]
        spacing[idx[1:]] = (last_end[idx[1:]] - last_end[idx[:-1]]) / 1e6
    out["spacing_ms"] = spacing
    start = out["ts_ns"].to_numpy()
    out["step_ms"] = (wall_end - start) / 1e6
    out["busy_ms"], out["host_wait_ms"] = _busy_and_waiting(gpu, g_end, launch_ts, start, wall_end)
    del g_end, launch_ts
    cats = per_event(gpu, category)[own]
    dur = exclusive_ns(gpu)[own]
    for cat in CATEGORIES:
        pick = cats == cat
        out[f"{cat} (ms)"] = np.bincount(step_ids[pick], weights=dur[pick], minlength=n) / 1e6
        out[f"{cat} kernels"] = np.bincount(step_ids[pick], minlength=n).astype(np.int64)
    return out


def _ops_in_steps(gpu: pd.DataFrame, step_of_corr: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """Which GPU ops a step launched (a mask over `gpu`), and the step of each of them."""
    g_step = step_of_corr.reindex(gpu["correlation"].to_numpy()).to_numpy()
    own = ~np.isnan(g_step)
    return own, g_step[own].astype(np.int64)


def _busy_and_waiting(gpu: pd.DataFrame, g_end: np.ndarray, launch_ts: pd.Series, start: np.ndarray,
                      wall_end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per step, ms the GPU was busy and ms it sat idle waiting for the host (`_host_wait_gaps`)."""
    g_ts = gpu["ts_ns"].to_numpy()
    seg_s, seg_e = union(g_ts, g_end)
    busy = covered_between(seg_s, seg_e, start, wall_end)
    wait_s, wait_e = _host_wait_gaps(seg_s, seg_e, g_ts, gpu["correlation"].to_numpy(), launch_ts,
                                     lo=int(min(start.min(initial=0), seg_s.min(initial=0))),
                                     hi=int(max(wall_end.max(initial=0), seg_e.max(initial=0))))
    return busy / 1e6, covered_between(wait_s, wait_e, start, wall_end) / 1e6


def exclusive_ns(gpu: pd.DataFrame) -> np.ndarray:
    """Each GPU op's time from the later of its start and the end of the ops before it on its stream, to its end.

    Work on one stream runs one op after another, so this is the op's duration, except under programmatic dependent
    launch (Hopper and later): there a kernel starts while the one before still runs and waits on the device for it,
    and its recorded span includes that wait. Summed by category, raw durations would count the wait twice."""
    ts = gpu["ts_ns"].to_numpy()
    end = ts + gpu["dur_ns"].to_numpy()
    order = np.lexsort((ts, gpu["stream"].to_numpy(), gpu["pid"].to_numpy()))
    frame = pd.DataFrame({"pid": gpu["pid"].to_numpy()[order], "stream": gpu["stream"].to_numpy()[order],
                          "end": end[order]})
    # the latest end among the ops that started earlier on the same stream (none for a stream's first op)
    pid_s, stream_s, end_s = frame["pid"].to_numpy(), frame["stream"].to_numpy(), frame["end"].to_numpy()
    cut = np.flatnonzero((pid_s[1:] != pid_s[:-1]) | (stream_s[1:] != stream_s[:-1])) + 1
    before = np.empty(len(end_s), dtype=np.int64)
    first = np.zeros(len(end_s), dtype=bool)
    for lo, hi in zip(np.concatenate(([0], cut)), np.concatenate((cut, [len(end_s)]))):
        if hi > lo:
            first[lo] = True
            before[lo + 1:hi] = np.maximum.accumulate(end_s[lo:hi - 1])
    start = ts[order].copy()
    start[~first] = np.maximum(start[~first], before[~first])
    out = np.empty(len(ts), dtype=np.int64)
    out[order] = np.maximum(end[order] - start, 0)
    return out


def _cpu_threads(events: pd.DataFrame) -> pd.MultiIndex:
    """The (pid, tid) pairs that ran a CPU operator or annotation (without copying the events to find them)."""
    cpu = events["kind"].isin(("cpu_op", "annotation")).to_numpy()
    pid, tid = events["pid"].to_numpy()[cpu], events["tid"].to_numpy()[cpu]
    # the first event of each run of one thread's events: a few thousand, where the events are hundreds of thousands
    first = np.flatnonzero(np.concatenate(([True], (pid[1:] != pid[:-1]) | (tid[1:] != tid[:-1]))))
    pairs = pd.DataFrame({"pid": pid[first], "tid": tid[first]})
    return pd.MultiIndex.from_frame(pairs.drop_duplicates())


def _launches_in_steps(runtime: pd.DataFrame, steps: pd.DataFrame, cpu_threads: pd.MultiIndex) -> pd.Series:
    """Step index of each launch call (by correlation id) made inside a step on the step's thread.

    Launch calls on a thread that has no CPU operator or annotation at all are matched by process and time
    instead: such a thread is not a real one but a stale id. The profiler records the runtime calls of a later
    capture in a process under the thread id of its first capture (Kineto's "External init callback must run in
    same thread as registerClient"), while the operators that made the calls carry the real thread.
    """
    if runtime.empty or steps.empty:
        return pd.Series(dtype=float)
    calls = pd.DataFrame({"ts_ns": runtime["ts_ns"].to_numpy(), "pid": runtime["pid"].to_numpy(),
                          "tid": runtime["tid"].to_numpy(), "correlation": runtime["correlation"].to_numpy()})
    ranges = pd.DataFrame({"ts_ns": steps["ts_ns"].to_numpy(), "pid": steps["pid"].to_numpy(),
                           "tid": steps["tid"].to_numpy(), "end_ns": steps["end_ns"].to_numpy(),
                           "step": np.arange(len(steps), dtype=np.float64)})
    ends = steps["end_ns"].to_numpy()
    stale = ~pd.MultiIndex.from_frame(calls[["pid", "tid"]]).isin(cpu_threads)
    parts = []
    for subset, by in ((calls[~stale], ["pid", "tid"]), (calls[stale], ["pid"])):
        if subset.empty:
            continue
        right = ranges if by == ["pid", "tid"] else ranges.drop(columns="tid")
        left = subset if by == ["pid", "tid"] else subset.drop(columns="tid")
        matched = pd.merge_asof(left.sort_values("ts_ns", kind="stable"), right.sort_values("ts_ns", kind="stable"),
                                on="ts_ns", by=by, direction="backward")
        step = matched["step"].to_numpy()
        found = ~np.isnan(step)
        inside = found.copy()  # compared in int64: `end_ns` turns float where a call follows no step
        inside[found] = matched["ts_ns"].to_numpy()[found] < ends[step[found].astype(np.int64)]
        parts.append(matched[inside])
    if not parts:
        return pd.Series(dtype=float)
    matched = pd.concat(parts)
    return pd.Series(matched["step"].to_numpy(), index=matched["correlation"].to_numpy())


def _host_wait_gaps(seg_s, seg_e, op_ts, op_corr, launch_ts: pd.Series, lo: int, hi: int):
    """The idle gaps of the GPU that end with work the CPU launched only after the gap began (plus the idle
    time before the first and after the last GPU work); no gaps where the rank ran no GPU work at all."""
    if seg_s.size == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    order = np.argsort(op_ts, kind="stable")
    first_op = order[np.searchsorted(op_ts[order], seg_s[1:], side="left")]
    launched = launch_ts.reindex(op_corr[first_op], fill_value=np.iinfo(np.int64).min).to_numpy()
    waits = launched > seg_e[:-1]  # launched after the GPU had gone idle; unknown launch: not host wait
    gap_s = np.concatenate(([lo], seg_e[:-1][waits], [seg_e[-1]]))
    gap_e = np.concatenate(([seg_s[0]], seg_s[1:][waits], [hi]))
    keep = gap_e > gap_s
    return gap_s[keep], gap_e[keep]


def phase_summary(steps: pd.DataFrame, has_gpu: bool) -> pd.DataFrame:
    """Per step type: count, step time, GPU busy and host-wait shares, kernels per step, and a verdict."""
    rows = []
    for kind, group in steps.groupby("type", sort=False):
        wall = group["step_ms"].sum()
        busy = group["busy_ms"].sum() / wall if wall else 0.0
        host = group["host_wait_ms"].sum() / wall if wall else 0.0
        step_ms = group["step_ms"].to_numpy()
        rows.append({
            "type": kind, "steps": len(group),
            "bs": group["bs"].astype(float).mean(), "toks": group["toks"].astype(float).mean(),
            "step_mean (ms)": step_ms.mean(), "step_p50 (ms)": np.percentile(step_ms, 50),
            "step_p99 (ms)": np.percentile(step_ms, 99), "cpu_mean (ms)": group["cpu_ms"].mean(),
            "spacing_p50 (ms)": _nanmedian(group["spacing_ms"].to_numpy()),
            "gpu_busy_share": busy, "host_wait_share": host,
            "kernels_per_step": group["kernels"].mean(),
            "verdict": verdict(busy, host) if has_gpu and group["gpu_ops"].sum() else "no GPU work",
        })
    return pd.DataFrame(rows)


def _nanmedian(values: np.ndarray) -> float:
    values = values[~np.isnan(values)]
    return float(np.median(values)) if values.size else float("nan")


CPU_BOUND = "CPU-bound"  # the verdict on a step type whose GPU waited for launches at least as long as it worked


def verdict(busy_share: float, host_wait_share: float) -> str:
    """CPU-bound when the GPU waited for launches at least as long as it worked (and waited at all)."""
    if host_wait_share > 0 and host_wait_share >= busy_share:
        return CPU_BOUND
    if busy_share >= GPU_BOUND_SHARE:
        return "GPU-bound"
    return "mixed"


def phase_categories(steps: pd.DataFrame) -> pd.DataFrame:
    """Per step type and kernel category: GPU time in total and per step, and its share of the type's time."""
    rows = []
    for kind, group in steps.groupby("type", sort=False):
        total = sum(group[f"{c} (ms)"].sum() for c in CATEGORIES)
        for cat in CATEGORIES:
            ms = group[f"{cat} (ms)"].sum()
            if ms > 0:
                rows.append({"type": kind, "category": cat, "total (ms)": ms, "per_step (ms)": ms / len(group),
                             "share": ms / total if total else 0.0})
    return pd.DataFrame(rows, columns=["type", "category", "total (ms)", "per_step (ms)", "share"])


def capture_categories(gpu_by_rank: dict[int, pd.DataFrame]) -> pd.DataFrame:
    """GPU time by kernel category over a whole capture (the GPU work of every rank), each op's from the end of
    the one before it on its stream (`exclusive_ns`)."""
    return combine_categories([rank_categories(gpu) for gpu in gpu_by_rank.values()])


def rank_categories(gpu: pd.DataFrame) -> pd.DataFrame:
    """One rank's GPU ops and exclusive nanoseconds per category (`combine_categories` adds ranks up)."""
    if gpu.empty:
        return pd.DataFrame(columns=["category", "ops", "total_ns"])
    frame = pd.DataFrame({"category": per_event(gpu, category), "dur_ns": exclusive_ns(gpu)})
    return frame.groupby("category").agg(ops=("dur_ns", "size"), total_ns=("dur_ns", "sum")).reset_index()


def combine_categories(parts: list[pd.DataFrame]) -> pd.DataFrame:
    parts = [p for p in parts if not p.empty]
    if not parts:
        return pd.DataFrame(columns=["category", "ops", "total (ms)", "share"])
    table = pd.concat(parts).groupby("category")[["ops", "total_ns"]].sum()
    table = table.reindex([c for c in CATEGORIES if c in table.index]).reset_index()
    table["total (ms)"] = table["total_ns"] / 1e6
    table["share"] = table["total_ns"] / table["total_ns"].sum()
    return table[["category", "ops", "total (ms)", "share"]]


def gpu_ops_by_step(events: pd.DataFrame, steps: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray]:
    """The rank's GPU ops and, for each, the index (into `steps`) of the step that launched it, -1 for none."""
    gpu = rows_of(events, events["kind"].isin(GPU_WORK).to_numpy(), GPU_COLUMNS)
    runtime = rows_of(events, (events["kind"] == "runtime").to_numpy() & (events["correlation"] >= 0).to_numpy(),
                      LAUNCH_COLUMNS)
    runtime = runtime.drop_duplicates("correlation", keep="first")
    cpu_threads = _cpu_threads(events)
    step_of_corr = _launches_in_steps(runtime, steps, cpu_threads)
    found = step_of_corr.reindex(gpu["correlation"].to_numpy()).to_numpy()
    return gpu, np.where(np.isnan(found), -1, found).astype(np.int64)


CPU_NESTING = ("cpu_op", "annotation", "runtime")  # what an operator's self time leaves out when nested inside it


def self_times(events: pd.DataFrame) -> pd.DataFrame:
    """The CPU operators (`cpu_op`) of one rank with their self time: the duration less that of the operators,
    annotations and runtime calls directly inside them on the same thread."""
    cpu = events[events["kind"].isin(CPU_NESTING).to_numpy()]
    if cpu.empty:
        return pd.DataFrame(columns=["name", "pid", "tid", "ts_ns", "dur_ns", "self_ns"])
    order = np.lexsort((-cpu["dur_ns"].to_numpy(), cpu["ts_ns"].to_numpy(), cpu["tid"].to_numpy(),
                        cpu["pid"].to_numpy()))
    pid, tid = cpu["pid"].to_numpy()[order], cpu["tid"].to_numpy()[order]
    ts, dur = cpu["ts_ns"].to_numpy()[order], cpu["dur_ns"].to_numpy()[order]
    end = ts + dur
    child_ns = np.zeros(len(order), dtype=np.int64)
    stack: list[int] = []
    for i in range(len(order)):
        if stack and (pid[stack[-1]] != pid[i] or tid[stack[-1]] != tid[i]):
            stack.clear()
        while stack and end[stack[-1]] <= ts[i]:
            stack.pop()
        if stack:  # the innermost open event encloses this one: its direct parent
            parent = stack[-1]
            child_ns[parent] += min(end[i], end[parent]) - ts[i]
        stack.append(i)
    self_ns = np.maximum(dur - child_ns, 0)
    is_op = (cpu["kind"] == "cpu_op").to_numpy()[order]
    return pd.DataFrame({"name": cpu["name"].astype(str).to_numpy()[order][is_op], "pid": pid[is_op],
                         "tid": tid[is_op], "ts_ns": ts[is_op], "dur_ns": dur[is_op], "self_ns": self_ns[is_op]})


CPU_TOP = 15  # operators listed per rank, and per step type


def cpu_operators(ops: pd.DataFrame, top: int = CPU_TOP) -> pd.DataFrame:
    """One rank's CPU operators by self time: calls, self and total (inclusive) time, share of all self time."""
    if ops.empty:
        return pd.DataFrame(columns=["name", "calls", "self (ms)", "self share", "total (ms)"])
    table = ops.groupby("name").agg(calls=("self_ns", "size"), self_ns=("self_ns", "sum"), total_ns=("dur_ns", "sum"))
    table = table.sort_values("self_ns", ascending=False, kind="stable")
    whole = table["self_ns"].sum()
    table = table.head(top).reset_index()
    return pd.DataFrame({"name": table["name"], "calls": table["calls"], "self (ms)": table["self_ns"] / 1e6,
                         "self share": table["self_ns"] / whole if whole else 0.0,
                         "total (ms)": table["total_ns"] / 1e6})


def cpu_in_steps(ops: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Self nanoseconds and calls per step type and operator, of the operators that start inside a step on its
    thread."""
    if ops.empty or steps.empty:
        return pd.DataFrame(columns=["type", "name", "self_ns", "calls"])
    ranges = pd.DataFrame({"ts_ns": steps["ts_ns"].to_numpy(), "pid": steps["pid"].to_numpy(),
                           "tid": steps["tid"].to_numpy(), "end_ns": steps["end_ns"].to_numpy(),
                           "type": steps["type"].to_numpy()}).sort_values("ts_ns", kind="stable")
    left = ops.sort_values("ts_ns", kind="stable")
    matched = pd.merge_asof(left, ranges, on="ts_ns", by=["pid", "tid"], direction="backward")
    inside = matched["end_ns"].notna().to_numpy().copy()
    inside[inside] = matched["ts_ns"].to_numpy()[inside] < matched["end_ns"].to_numpy()[inside].astype(np.int64)
    inside &= matched["name"].to_numpy() != matched["type"].to_numpy()
    return matched[inside].groupby(["type", "name"], sort=False).agg(
        self_ns=("self_ns", "sum"), calls=("self_ns", "size")).reset_index()


GPU_PHASE_COLUMNS = ("gpu_busy_share", "host_wait_share", "kernels_per_step")  # meaningless without GPU work


def cpu_phase_summary(phases: pd.DataFrame, parts: list[pd.DataFrame]) -> pd.DataFrame:
    """A CPU-only capture's step types: CPU operators per step (from `cpu_in_steps` of every rank) in place of the
    GPU figures, which are all zero there."""
    calls: dict[str, int] = {}
    for part in parts:
        if not part.empty:
            for kind, n in part.groupby("type", sort=False)["calls"].sum().items():
                calls[kind] = calls.get(kind, 0) + int(n)
    out = phases.drop(columns=[c for c in GPU_PHASE_COLUMNS if c in phases.columns])
    per_step = [calls.get(kind, 0) / n if n else float("nan") for kind, n in zip(out["type"], out["steps"])]
    out.insert(out.columns.get_loc("verdict"), "cpu_ops_per_step", per_step)
    return out


def cpu_steps_table(parts: list[pd.DataFrame], steps: pd.DataFrame, top: int = 10) -> pd.DataFrame:
    """Per step type, the operators with the most self time per step, over every rank's steps."""
    parts = [p for p in parts if not p.empty]
    if not parts or steps.empty:
        return pd.DataFrame(columns=["type", "name", "steps", "self per step (ms)", "share of step"])
    raw = pd.concat(parts).groupby(["type", "name"], sort=False)["self_ns"].sum().reset_index()
    rows = []
    for kind, g in raw.groupby("type", sort=False):
        of_type = steps[steps["type"] == kind]
        count, wall_ms = len(of_type), of_type["step_ms"].sum()
        for r in g.sort_values("self_ns", ascending=False, kind="stable").head(top).to_dict("records"):
            rows.append({"type": kind, "name": r["name"], "steps": count,
                         "self per step (ms)": r["self_ns"] / 1e6 / count if count else float("nan"),
                         "share of step": r["self_ns"] / 1e6 / wall_ms if wall_ms else float("nan")})
    return pd.DataFrame(rows)
