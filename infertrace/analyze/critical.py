"""The cross-rank critical path of each engine step: which rank, and which kernel or collective, held it up.

In tensor- (or pipeline-) parallel inference every rank runs the same step, and the step's collectives (all-reduce,
all-gather, ...) synchronise the ranks: a collective finishes only after the last rank has arrived at it. A rank's
step is therefore a chain of segments, each the rank's own work from the end of one collective (or the start of the
step) to its arrival at the next collective (or the end of the step), with the collectives between them. The step
takes, for each segment, as long as the slowest rank's segment, plus each collective's own transfer time:

    critical = sum over segments j of max over ranks r of segment(r, j)  +  sum over collectives of transfer

where a collective's transfer time is its shortest duration over the ranks (the last rank to arrive waits least, so
its kernel is the transfer alone). Segments and transfers are measured on each rank's own clock, so ranks on
different hosts need no common clock. The critical path runs through, for each segment, the rank with the longest
one; the gate of a step is the largest item on that path (a segment, named by the rank and its longest kernel, or a
collective's transfer), and the step's gating rank is the rank whose segments on the path exceed the other ranks'
median by the most. What-if: the time the step would save if the gating rank ran each segment at the median rank's
speed (the median over ranks of that segment), all else equal.

Steps are matched across ranks by order (as `ranks.py` does), collectives within a step by order; a step whose ranks
ran different numbers of collectives is compared as one segment, from its start to its end.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from infertrace.analyze.kernels import category, per_event, short_name
from infertrace.analyze.phases import gpu_ops_by_step

PATH_COLUMNS = ["step", "type", "segment", "start_ns", "arrive_ns", "seg_ns", "kernel", "kernel_ns", "busy_ns",
                "collective", "coll_start_ns", "coll_ns"]
HOST_BOUND = 0.5  # a segment whose GPU ran less than this share of it is named for the host, not its longest kernel


def step_path(events: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """One rank's steps cut at their collectives: per step (in time order) and segment j = 0..J, the segment's
    start and arrival at collective j+1 (or the step's end, for the last segment), its longest kernel, and the
    collective that ends it (name, start, duration)."""
    steps = steps.sort_values("ts_ns", kind="stable").reset_index(drop=True)
    if steps.empty:
        return pd.DataFrame(columns=PATH_COLUMNS)
    gpu, step_of = gpu_ops_by_step(events, steps)
    own = step_of >= 0
    gpu, step_of = gpu[own], step_of[own]
    cats = per_event(gpu, category)
    names = gpu["name"].astype(str).to_numpy()
    ts = gpu["ts_ns"].to_numpy()
    end = ts + gpu["dur_ns"].to_numpy()
    is_comm = (cats == "communication") & (gpu["kind"] == "kernel").to_numpy()
    order = np.lexsort((ts, step_of))
    step_of, ts, end, is_comm, names = step_of[order], ts[order], end[order], is_comm[order], names[order]
    start = steps["ts_ns"].to_numpy()
    stop = start + np.rint(steps["step_ms"].to_numpy() * 1e6).astype(np.int64)
    return segments(step_of, ts, end, is_comm, names, start, stop, steps["type"].to_numpy())


def segments(step_of: np.ndarray, ts: np.ndarray, end: np.ndarray, is_comm: np.ndarray, names: np.ndarray,
             start: np.ndarray, stop: np.ndarray, types: np.ndarray) -> pd.DataFrame:
    """`step_path`'s table from the GPU ops ordered by (step, start) and the steps' starts, ends and types: one row
    per collective (the segment that arrives at it) and one per step for its last segment, all at once in numpy."""
    n_steps, n_ops = start.size, ts.size
    bounds = np.searchsorted(step_of, np.arange(n_steps + 1))  # step k's ops: bounds[k] to bounds[k + 1]
    comm_at = np.flatnonzero(is_comm)
    # each row's op range ends at its collective (or at the step's end, for the last segment), in (step, op) order
    row_step = np.concatenate((step_of[comm_at], np.arange(n_steps)))
    row_end = np.concatenate((comm_at, bounds[1:]))
    order = np.lexsort((row_end, row_step))
    row_step, row_end = row_step[order], row_end[order]
    has_coll = np.concatenate((np.ones(comm_at.size, dtype=bool), np.zeros(n_steps, dtype=bool)))[order]
    n_rows = row_step.size
    first_row = np.searchsorted(row_step, np.arange(n_steps))
    segment = np.arange(n_rows) - first_row[row_step]
    opens = segment == 0
    prev = np.maximum(np.arange(n_rows) - 1, 0)
    row_begin = np.where(opens, bounds[row_step], row_end[prev] + 1)  # just past the collective before
    coll_at = np.minimum(row_end, max(n_ops - 1, 0))  # the row's collective, where it has one
    seg_start = np.where(opens, start[row_step], end[np.minimum(row_end[prev], n_ops - 1)] if n_ops else 0)
    arrive = np.where(has_coll, ts[coll_at] if n_ops else 0, np.maximum(stop[row_step], seg_start))
    # the work ops: each row's range, in row order, covers them all
    lengths = row_end - row_begin
    work = np.flatnonzero(~is_comm)
    rid = np.repeat(np.arange(n_rows), lengths)
    kernel = np.full(n_rows, "", dtype=object)
    kernel_ns = np.zeros(n_rows, dtype=np.int64)
    busy_ns = np.zeros(n_rows, dtype=np.int64)
    if work.size:
        w_ts, w_end = ts[work], end[work]
        took = w_end - w_ts
        begins = np.flatnonzero(np.concatenate(([True], rid[1:] != rid[:-1])))  # each non-empty row's first op
        rows = rid[begins]
        longest_ns = np.maximum.reduceat(took, begins)
        is_longest = took == longest_ns[np.searchsorted(rows, rid)]
        first_longest = np.flatnonzero(is_longest)
        _, pick = np.unique(rid[first_longest], return_index=True)  # the first op of its row at that length
        longest = work[first_longest[pick]]
        kernel[rows] = names[longest]
        kernel_ns[rows] = end[longest] - ts[longest]
        # the union of each row's ops clipped to its segment (starts already in order within a row)
        s = np.maximum(w_ts, seg_start[rid])
        e = np.minimum(w_end, np.maximum(arrive, seg_start)[rid])
        values, rank = np.unique(e, return_inverse=True)
        reach = values[np.maximum.accumulate(rid * values.size + rank) - rid * values.size]  # running max per row
        new = np.ones(s.size, dtype=bool)
        new[1:] = (rid[1:] != rid[:-1]) | (s[1:] > reach[:-1])
        groups = np.flatnonzero(new)
        np.add.at(busy_ns, rid[groups], np.maximum.reduceat(e, groups) - s[groups])
    coll_name = np.where(has_coll, names[coll_at] if n_ops else "", "")
    return pd.DataFrame({
        "step": row_step.tolist(), "type": types[row_step].tolist(), "segment": segment.tolist(),
        "start_ns": seg_start.tolist(), "arrive_ns": arrive.tolist(),
        "seg_ns": np.maximum(arrive - seg_start, 0).tolist(), "kernel": kernel.tolist(),
        "kernel_ns": kernel_ns.tolist(), "busy_ns": busy_ns.tolist(), "collective": coll_name.tolist(),
        "coll_start_ns": np.where(has_coll, ts[coll_at] if n_ops else 0, -1).tolist(),
        "coll_ns": np.where(has_coll, (end - ts)[coll_at] if n_ops else 0, 0).tolist(),
    }, columns=PATH_COLUMNS)


def critical_path(paths: dict[int, pd.DataFrame]) -> pd.DataFrame:
    """Per step, over the ranks' `step_path` tables: the critical time, the gating rank and item, and the what-if
    saving (see the module's docstring). One rank gives the path through its own collectives, and no what-if."""
    ranks = sorted(r for r, p in paths.items() if not p.empty)
    if not ranks:
        return pd.DataFrame()
    cols = {r: {c: paths[r][c].to_numpy() for c in PATH_COLUMNS} for r in ranks}
    bounds = {r: np.searchsorted(cols[r]["step"], np.arange(int(cols[r]["step"].max()) + 2)) for r in ranks}
    n = min(len(bounds[r]) - 1 for r in ranks)
    rows, segments = [], []
    for k in range(n):
        per = [{c: v[bounds[r][k]:bounds[r][k + 1]] for c, v in cols[r].items()} for r in ranks]
        if any(p["step"].size == 0 for p in per):
            continue
        counts = {p["step"].size for p in per}
        aligned = len(counts) == 1
        if aligned:
            seg = np.stack([p["seg_ns"] for p in per])  # ranks x segments
            coll = np.stack([p["coll_ns"][:-1] for p in per])
            kernels = [_labels(p["kernel"], p["busy_ns"], p["seg_ns"]) for p in per]
            coll_names = per[0]["collective"][:-1]
        else:  # the ranks ran different collectives: the whole step as one segment
            seg = np.array([[int(p["arrive_ns"][-1] - p["start_ns"][0])] for p in per])
            coll = np.zeros((len(per), 0), dtype=np.int64)
            kernels = [np.array([_label(p["kernel"][int(np.argmax(p["kernel_ns"]))], int(p["busy_ns"].sum()),
                                        int(p["arrive_ns"][-1] - p["start_ns"][0]))]) for p in per]
            coll_names = np.array([], dtype=object)
        slowest = seg.argmax(axis=0)
        seg_max = seg.max(axis=0)
        transfer = coll.min(axis=0) if coll.size else np.zeros(0, dtype=np.int64)
        critical = int(seg_max.sum() + transfer.sum())
        median = np.median(seg, axis=0)
        excess = np.where(np.arange(len(ranks))[:, None] == slowest[None, :], seg - median[None, :], 0).sum(axis=1)
        gate_rank_i = int(excess.argmax())
        saved = None
        if len(ranks) > 1:
            others = np.delete(seg, gate_rank_i, axis=0).max(axis=0)
            saved = int(seg_max.sum() - np.maximum(others, median).sum())
        # the largest item on the path: a segment (its rank's longest kernel) or a collective's transfer
        big_seg = int(seg_max.argmax())
        big_coll = int(transfer.argmax()) if transfer.size else -1
        if big_coll >= 0 and transfer[big_coll] > seg_max[big_seg]:
            gate, gate_kind, gate_ns = coll_names[big_coll], "collective", int(transfer[big_coll])
            gate_rank = ranks[int(coll[:, big_coll].argmin())]
        else:
            gate_rank = ranks[int(slowest[big_seg])]
            gate = kernels[int(slowest[big_seg])][big_seg]
            gate_kind, gate_ns = "segment", int(seg_max[big_seg])
        row = {
            "step": k, "type": per[0]["type"][0], "ranks": len(ranks), "collectives": int(coll.shape[1]),
            "critical (ms)": critical / 1e6, "transfer (ms)": int(transfer.sum()) / 1e6,
            "gating rank": ranks[gate_rank_i], "gate": str(gate),
            "gate kind": gate_kind, "gate rank": gate_rank, "gate (ms)": gate_ns / 1e6,
            "path": ",".join(str(ranks[i]) for i in slowest),
        }
        if saved is not None:  # one rank has no median to run at
            row["what-if saved (ms)"] = saved / 1e6
            row["what-if share"] = saved / critical if critical else 0.0
        rows.append(row)
        if aligned:
            for j, i in enumerate(slowest):
                p = per[i]
                segments.append({"step": k, "segment": j, "rank": ranks[i], "start_ns": int(p["start_ns"][j]),
                                 "arrive_ns": int(p["arrive_ns"][j]), "kernel": kernels[i][j],
                                 "collective": _short(p["collective"][j]), "coll_ns": int(p["coll_ns"][j])})
    table = pd.DataFrame(rows)
    table.attrs["segments"] = pd.DataFrame(segments)
    return table


def _label(kernel: str, busy_ns: int, seg_ns: int) -> str:
    """What a segment of the path is named for: its longest kernel, or the host when the GPU was mostly idle."""
    name = _short(kernel)
    if seg_ns > 0 and busy_ns < HOST_BOUND * seg_ns:
        share = f"{100 * busy_ns / seg_ns:.0f}%"
        return f"host (GPU busy {share} of it; longest kernel {name})" if name else "host (no GPU work)"
    return name


def _labels(kernels, busy, seg) -> np.ndarray:
    return np.array([_label(k, int(b), int(s)) for k, b, s in zip(kernels, busy, seg)], dtype=object)


_SHORT: dict[str, str] = {}


def _short(name: str) -> str:
    if name not in _SHORT:
        _SHORT[name] = short_name(str(name), width=None) if name else ""
    return _SHORT[name]


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per step type: steps, mean critical time, the rank that gated most often (and how often), the most frequent
    gate, and the mean what-if saving."""
    rows = []
    for kind, g in table.groupby("type", sort=False):
        counts = g["gating rank"].value_counts()
        gates = g["gate"].value_counts()
        row = {"type": kind, "steps": len(g), "critical mean (ms)": g["critical (ms)"].mean(),
               "transfer mean (ms)": g["transfer (ms)"].mean(),
               "gating rank": int(counts.idxmax()), "gating share": counts.max() / len(g),
               "top gate": str(gates.idxmax())}
        if "what-if saved (ms)" in g:
            row["what-if saved mean (ms)"] = g["what-if saved (ms)"].mean()
            total = g["critical (ms)"].sum()
            row["what-if share"] = g["what-if saved (ms)"].sum() / total if total else 0.0
        rows.append(row)
    return pd.DataFrame(rows)
