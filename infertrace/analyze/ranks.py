"""Several ranks of one capture side by side: each rank's collective-communication time and share per step type,
the part of it no computation hides (exposed), and the cross-rank skew of step ends (which rank finished each step
last, and by how much).

Communication in a step is, on a trace with GPU kernels, the time of its communication kernels (NCCL, and the
all-reduce kernels not named nccl, as kernels.py classifies them); on a CPU-only trace (gloo) the time of the
collective operators (`c10d::allreduce_`, `c10d::allgather_`, ...) on the stepping thread. Exposed communication:
on the GPU, communication time during which no computation kernel runs (memory copies hide nothing, as in HTA's
communication/computation overlap, which the first step's figures equal); on the CPU a collective blocks the thread
that steps, so all of it is exposed. Steps are matched across ranks by order: the k-th step of every rank is the
same engine step (rank 0 plans each step and every rank runs it).
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from infertrace.analyze.events import GPU_COLUMNS, GPU_WORK, rows_of
from infertrace.analyze.intervals import covered_between, union
from infertrace.analyze.kernels import category, per_event

CPU_COLLECTIVE = re.compile(r"^c10d::(all_?reduce|all_?gather|reduce_?scatter|broadcast|all_?to_?all|reduce|gather|"
                            r"scatter)", re.IGNORECASE)


def step_communication(events: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """One rank's steps (phases.step_metrics) with `comm_ms` and `exposed_comm_ms` per step."""
    out = steps[["type", "ts_ns", "step_ms"]].copy()
    start = steps["ts_ns"].to_numpy()
    end = start + (steps["step_ms"].to_numpy() * 1e6).astype(np.int64)
    gpu = rows_of(events, events["kind"].isin(GPU_WORK).to_numpy(), GPU_COLUMNS)
    if not gpu.empty:
        cats = per_event(gpu, category)
        s, e = gpu["ts_ns"].to_numpy(), (gpu["ts_ns"] + gpu["dur_ns"]).to_numpy()
        is_comm = cats == "communication"
        is_compute = ~is_comm & (gpu["kind"] == "kernel").to_numpy()  # copies hide nothing, as in HTA's overlap
        comm = union(s[is_comm], e[is_comm])
        compute = union(s[is_compute], e[is_compute])
        comm_ns = covered_between(*comm, start, end)
        both = _intersection(comm, compute)
        hidden_ns = covered_between(*both, start, end)
        out["comm_ms"] = comm_ns / 1e6
        out["exposed_comm_ms"] = (comm_ns - hidden_ns) / 1e6
        return out
    cpu = events[(events["kind"] == "cpu_op").to_numpy()]
    names = cpu["name"].astype(str)
    ops = cpu[names.str.match(CPU_COLLECTIVE).to_numpy()]
    comm = union(ops["ts_ns"].to_numpy(), (ops["ts_ns"] + ops["dur_ns"]).to_numpy())
    comm_ns = covered_between(*comm, start, end)
    out["comm_ms"] = comm_ns / 1e6
    out["exposed_comm_ms"] = comm_ns / 1e6
    return out


def _intersection(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The segments covered by both disjoint unions `a` and `b`, in time order."""
    (a_s, a_e), (b_s, b_e) = a, b
    first = np.searchsorted(b_e, a_s, side="right")  # per segment of `a`, the segments of `b` that overlap it
    stop = np.searchsorted(b_s, a_e, side="left")
    count = np.maximum(stop - first, 0)
    i = np.repeat(np.arange(a_s.size), count)
    j = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count) + np.repeat(first, count)
    lo, hi = np.maximum(a_s[i], b_s[j]).astype(np.int64), np.minimum(a_e[i], b_e[j]).astype(np.int64)
    keep = lo < hi  # a segment of no length (a kernel of 0 ns) overlaps nothing
    return lo[keep], hi[keep]


def rank_communication(per_rank: dict[int, pd.DataFrame]) -> pd.DataFrame:
    """Per step type and rank: steps, mean step time, mean communication and exposed communication per step,
    and their shares of step time."""
    rows = []
    for rank, steps in sorted(per_rank.items()):
        for kind, g in steps.groupby("type", sort=False):
            step_ms, comm_ms, exposed = g["step_ms"].sum(), g["comm_ms"].sum(), g["exposed_comm_ms"].sum()
            rows.append({"type": kind, "rank": rank, "steps": len(g), "step mean (ms)": g["step_ms"].mean(),
                         "all-reduce mean (ms)": g["comm_ms"].mean(),
                         "all-reduce share": comm_ms / step_ms if step_ms else float("nan"),
                         "exposed mean (ms)": g["exposed_comm_ms"].mean(),
                         "exposed share": exposed / step_ms if step_ms else float("nan")})
    return pd.DataFrame(rows)


def step_skew(per_rank: dict[int, pd.DataFrame]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per step: index, type, the rank that ended last, skew in ms) and (per step type: steps compared, skew
    p50/p99/max, and how often each rank was last), over the steps every rank has."""
    ranks = sorted(per_rank)
    n = min((len(per_rank[r]) for r in ranks), default=0)
    if len(ranks) < 2 or n == 0:
        return pd.DataFrame(), pd.DataFrame()
    ends = np.stack([(per_rank[r]["ts_ns"].to_numpy()[:n]
                      + (per_rank[r]["step_ms"].to_numpy()[:n] * 1e6).astype(np.int64)) for r in ranks])
    last = ends.argmax(axis=0)
    skew_ms = (ends.max(axis=0) - ends.min(axis=0)) / 1e6
    per_step = pd.DataFrame({"step": np.arange(n), "type": per_rank[ranks[0]]["type"].to_numpy()[:n],
                             "last rank": np.array(ranks)[last], "skew (ms)": skew_ms})
    rows = []
    for kind, g in per_step.groupby("type", sort=False):
        counts = g["last rank"].value_counts()
        rows.append({"type": kind, "steps": len(g), "skew p50 (ms)": g["skew (ms)"].quantile(0.5),
                     "skew p99 (ms)": g["skew (ms)"].quantile(0.99), "skew max (ms)": g["skew (ms)"].max(),
                     "straggler": int(counts.idxmax()), "straggler share": counts.max() / len(g)})
    return per_step, pd.DataFrame(rows)


def multi_rank_tables(events: dict[int, pd.DataFrame], steps: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The multi-rank tables of a capture whose steps table (report._steps) holds two ranks or more."""
    if steps is None or steps.empty or steps["rank"].nunique() < 2:
        return {}
    per_rank = {}
    for rank, g in steps.groupby("rank"):
        g = g.sort_values("ts_ns", kind="stable").reset_index(drop=True)
        per_rank[int(rank)] = step_communication(events[rank], g)
    return tables_of(per_rank)


def tables_of(per_rank: dict[int, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """The multi-rank tables from each rank's `step_communication` (steps in time order)."""
    _, summary = step_skew(per_rank)
    return {"rank_communication": rank_communication(per_rank), "step_skew": summary}
