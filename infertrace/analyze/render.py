"""Reports as rich tables for the terminal, from each table's rows as plain dicts: a report's DataFrames become
rows here, and a report read back from the cache (report_cache.py) is rows already, so this module imports neither
pandas nor numpy."""

from __future__ import annotations

import math
from itertools import groupby
from typing import TYPE_CHECKING

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from infertrace.analyze.categories import CATEGORIES

if TYPE_CHECKING:
    import pandas as pd

    from infertrace.analyze.report import Report

Rows = list[dict]
SHOWN_REQUEST_STEPS = 30  # steps listed in the terminal's requests table; --json and --csv hold them all

TITLES = {
    "temporal": "Temporal breakdown (HTA)",
    "idle": "GPU idle time by cause (HTA)",
    "kernel_types": "GPU time by kernel type (HTA; communication includes non-nccl collectives)",
    "top_kernels": "Top kernels per rank and type (HTA's selection)",
    "overlap": "Communication / computation overlap",
    "launches": "Kernel launches (all launch APIs, graph launches included)",
    "categories": "GPU time by kernel category",
    "phases": "Inference phases by step type",
    "phase_categories": "GPU time per step by kernel category",
    "frontend": "API server (frontend) CPU trace: busiest operations",
    "rank_communication": "Communication per rank and step type (all-reduce and other collectives)",
    "step_skew": "Cross-rank skew of step ends (the straggler ends each step last)",
    "step_requests": "Requests per step (the request log beside the capture; GPU time by token share)",
    "critical_summary": "Cross-rank critical path by step type (through the collectives; what-if: the gating rank "
                        "at the median rank's speed)",
    "critical_path": "Critical path of each step: gating rank, gate, what-if",
    "cpu_ops": "CPU operators by self time (no GPU activity in the capture)",
    "cpu_steps": "CPU operators per step (self time)",
}

# column headers shared by the terminal and the HTML page (`html.display`), where the table's field names read badly
LABELS = {
    "phases": {
        "type": "step type", "step_mean (ms)": "step mean (ms)", "step_p50 (ms)": "step p50 (ms)",
        "step_p99 (ms)": "step p99 (ms)", "spacing_p50 (ms)": "spacing p50 (ms)", "gpu_busy_share": "GPU busy",
        "host_wait_share": "host wait", "kernels_per_step": "kernels/step", "cpu_ops_per_step": "CPU ops/step",
    },
}


def render(report: Report, fit: bool = True) -> RenderableType:
    """The report's tables. `fit` caps label columns (kernel names at 56 characters, others at 24, cut with `…`)
    to suit a terminal; without it (a CI log, a pipe) every label is shown whole."""
    from infertrace.analyze.persist import report_dict

    return render_document(report_dict(report), fit)


def render_document(doc: dict, fit: bool = True) -> RenderableType:
    """`render` of a report as `analyze --json` writes it (persist.report_dict): its tables as rows."""
    tables = doc.get("tables") or {}
    parts: list[RenderableType] = [_ranks(doc.get("source", ""), doc.get("ranks") or [])]
    for name, build in _BUILDERS.items():
        rows = tables.get(name)
        if rows:
            parts.append(build(rows))
    skipped = doc.get("skipped") or {}
    if skipped:
        lines = [f"  {name}: {why}" for name, why in skipped.items() if name in TITLES]
        if lines:
            parts.append(Text("Not shown:\n" + "\n".join(lines), style="dim"))
    return _group(parts, fit)


def _group(parts: list[RenderableType], fit: bool) -> Group:
    if not fit:
        for part in parts:
            for column in getattr(part, "columns", ()):
                column.max_width = None
    return Group(*parts)


def _new(title: str, *columns: str, text: int = 1, caption: str | None = None, wide: int = 0) -> Table:
    """A table whose first `text` columns are left-aligned labels kept on one line, the rest right-aligned
    numbers; label column `wide` (an index) gets room for long kernel names."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, caption=caption, caption_justify="left",
                  padding=(0, 1), pad_edge=False)
    for i, col in enumerate(columns):
        if i < text:
            table.add_column(col, justify="left", no_wrap=True, overflow="ellipsis",
                             min_width=20 if wide and i == wide else None, max_width=56 if i == wide else 24)
        else:
            table.add_column(col, justify="right", no_wrap=col == "verdict", min_width=9 if col == "verdict" else None)
    return table


def _ms(us: float) -> str:
    return _num(us / 1000.0)


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _num(value: float, digits: int | None = None) -> str:
    if _missing(value):
        return "–"
    if digits is None:
        digits = 3 if abs(value) < 1 else 2 if abs(value) < 100 else 1
    return f"{value:,.{digits}f}"


def _fixed(value: float, digits: int, suffix: str = "") -> str:
    """`value` with exactly `digits` decimals (and `suffix`), "–" where it is missing."""
    return "–" if _missing(value) else f"{value:.{digits}f}{suffix}"


def _count(value) -> str:
    return "–" if _missing(value) else f"{int(value):,}"


def _pct(share: float) -> str:
    return "–" if _missing(share) else f"{100 * share:.1f}%"


def _ranks(source: str, rows: Rows) -> Table:
    table = _new(f"infertrace analyze: {source}", "rank", "file", "device", "events", "kernels", "gpu ops", text=3)
    for r in rows:
        table.add_row(str(r["rank"]), str(r["file"]), str(r.get("device") or "–"), _count(r["events"]),
                      _count(r["kernels"]), _count(r["gpu_ops"]))
    return table


def _temporal(rows: Rows) -> Table:
    table = _new(TITLES["temporal"], "rank", "kernel span (ms)", "idle", "compute", "non-compute")
    for r in rows:
        table.add_row(str(r["rank"]), _ms(r["kernel_time(us)"]), _fixed(r["idle_time_pctg"], 2, "%"),
                      _fixed(r["compute_time_pctg"], 2, "%"), _fixed(r["non_compute_time_pctg"], 2, "%"))
    return table


def _idle(rows: Rows) -> Table:
    table = _new(TITLES["idle"], "rank", "stream", "host wait (ms)", "kernel wait (ms)", "other (ms)",
                 "host wait share", text=2, caption="host wait: the next kernel was launched after the GPU went idle; "
                                            "kernel wait: gaps under 30 us between kernels")
    sums: dict[tuple, dict[str, float]] = {}  # (rank, stream) -> idle time by category, summed
    for r in rows:
        cell = sums.setdefault((r["rank"], r["stream"]), {})
        cell[r["idle_category"]] = cell.get(r["idle_category"], 0.0) + (r["idle_time (us)"] or 0.0)
    for (rank, stream), cell in sorted(sums.items()):
        host, kernel, other = (cell.get(c, 0.0) for c in ("host_wait", "kernel_wait", "other"))
        total = host + kernel + other
        table.add_row(str(rank), str(stream), _ms(host), _ms(kernel), _ms(other),
                      _pct(host / total) if total else "–")
    return table


def _kernel_types(rows: Rows) -> Table:
    table = _new(TITLES["kernel_types"], "type", "time (ms)", "share")
    for r in rows:
        table.add_row(r["kernel_type"], _ms(r["sum (us)"]), _fixed(r["percentage"], 1, "%"))
    return table


def _top_kernels(rows: Rows) -> Table:
    table = _new(TITLES["top_kernels"], "rank", "type", "kernel", "category", "count", "total (ms)",
                 "mean (us)", text=4, wide=2)
    # by rank and type, "others" last in each, then the longest total first
    ordered = sorted(rows, key=lambda r: (r["rank"], r["kernel_type"], r["name"] == "others", -r["sum (us)"]))
    for r in ordered:
        table.add_row(str(r["rank"]), _TYPE_ABBREV.get(r["kernel_type"], r["kernel_type"]), r["short_name"],
                      r["category"] or "", _count(r["count"]), _ms(r["sum (us)"]), _num(r["mean (us)"]))
    return table


_TYPE_ABBREV = {"COMPUTATION": "comp", "COMMUNICATION": "comm", "MEMORY": "mem"}


def _overlap(rows: Rows) -> Table:
    table = _new(TITLES["overlap"], "rank", "communication (ms)", "overlapped (ms)", "overlap")
    for r in rows:
        pct = r["comp_comm_overlap_pctg"]
        table.add_row(str(r["rank"]), _ms(r["comm_time(us)"]), _ms(r["overlapped_time(us)"]),
                      "no communication" if _missing(pct) else f"{pct:.2f}%")
    return table


def _launches(rows: Rows) -> Table:
    table = _new(TITLES["launches"], "rank", "api", "calls", "gpu ops", "cpu mean (us)", "cpu p99 (us)",
                 "delay mean (us)", "delay p99 (us)", text=2,
                 caption="delay: from the end of the launch call to the start of its first GPU work")
    for r in rows:
        table.add_row(str(r["rank"]), r["api"], _count(r["launches"]), _count(r["gpu_ops"]),
                      _num(r["cpu_mean (us)"]), _num(r["cpu_p99 (us)"]), _num(r["delay_mean (us)"]),
                      _num(r["delay_p99 (us)"]))
    return table


def _categories(rows: Rows) -> Table:
    table = _new(TITLES["categories"], "category", "ops", "time (ms)", "share")
    for r in rows:
        table.add_row(r["category"], _count(r["ops"]), _num(r["total (ms)"]), _pct(r["share"]))
    return table


def _phases(rows: Rows) -> Table:
    # spacing only where some step type has two steps with GPU work (a single-step capture has none)
    spacing = any(not _missing(r.get("spacing_p50 (ms)")) for r in rows)
    gpu = any("gpu_busy_share" in r for r in rows)  # a CPU-only capture has CPU operators per step instead
    caption = "step time: from the step's start to its end or its last kernel's end, whichever is later; "
    if spacing:
        caption += ("spacing: from the previous step's last kernel to this one's, the rate steps complete at (also "
                    "when a step is queued before the one ahead ends); ")
    caption += ("CPU-bound: the GPU waited for launches at least as long as it worked" if gpu
                else "CPU ops: the CPU operators that start inside the step")
    label = LABELS["phases"]
    figures = ["gpu_busy_share", "host_wait_share", "kernels_per_step"] if gpu else ["cpu_ops_per_step"]
    table = _new(TITLES["phases"], label["type"], "steps", "bs", "toks", label["step_mean (ms)"],
                 label["step_p50 (ms)"], label["step_p99 (ms)"], *([label["spacing_p50 (ms)"]] if spacing else []),
                 *[label[f] for f in figures], "verdict", text=1, caption=caption)
    for r in rows:
        verdict = r["verdict"] or ""
        style = {"CPU-bound": "bold yellow", "GPU-bound": "green"}.get(verdict, "")
        cells = ([_pct(r["gpu_busy_share"]), _pct(r["host_wait_share"]), _num(r["kernels_per_step"], 1)] if gpu
                 else [_num(r.get("cpu_ops_per_step"), 1)])
        table.add_row(r["type"], _count(r["steps"]), _num(r["bs"], 1), _num(r["toks"], 0),
                      _num(r["step_mean (ms)"]), _num(r["step_p50 (ms)"]), _num(r["step_p99 (ms)"]),
                      *([_num(r["spacing_p50 (ms)"])] if spacing else []), *cells, Text(verdict, style=style))
    return table


def _phase_categories(rows: Rows) -> Table:
    present = [c for c in CATEGORIES if c in {r["category"] for r in rows}]
    table = _new(TITLES["phase_categories"], "step type", *[f"{c} (ms)" for c in present])
    order = list(dict.fromkeys(r["type"] for r in rows))  # the step types in the order they first come
    for kind in order:
        cells = {r["category"]: (r["per_step (ms)"], r["share"]) for r in rows if r["type"] == kind}
        table.add_row(kind, *[f"{_num(cells[c][0])} ({_pct(cells[c][1])})" if c in cells else "–"
                              for c in present])
    return table


def _frontend(rows: Rows) -> Table:
    table = _new(TITLES["frontend"], "operation", "count", "total (ms)", "max (ms)", wide=0)
    for r in rows:
        table.add_row(str(r["name"]), str(r["count"]), _fixed(r["sum (us)"] / 1000, 3),
                      _fixed(r["max (us)"] / 1000, 3))
    return table


def _rank_communication(rows: Rows) -> Table:
    table = _new(TITLES["rank_communication"], "step type", "rank", "steps", "step mean (ms)",
                 "communication (ms)", "share", "exposed (ms)", "exposed share")
    for r in rows:
        table.add_row(str(r["type"]), str(r["rank"]), str(r["steps"]), _fixed(r["step mean (ms)"], 3),
                      _fixed(r["all-reduce mean (ms)"], 3), _pct(r["all-reduce share"]),
                      _fixed(r["exposed mean (ms)"], 3), _pct(r["exposed share"]))
    return table


def _step_skew(rows: Rows) -> Table:
    table = _new(TITLES["step_skew"], "step type", "steps", "skew p50 (ms)", "skew p99 (ms)", "skew max (ms)",
                 "straggler", "last in")
    for r in rows:
        table.add_row(str(r["type"]), str(r["steps"]), _fixed(r["skew p50 (ms)"], 3), _fixed(r["skew p99 (ms)"], 3),
                      _fixed(r["skew max (ms)"], 3), f"rank {r['straggler']}", _pct(r["straggler share"]))
    return table


def _critical_summary(rows: Rows) -> Table:
    table = _new(TITLES["critical_summary"], "step type", "steps", "critical mean (ms)", "transfer mean (ms)",
                 "gating rank", "gating share", "top gate", "what-if saved (ms)", "what-if share")
    for r in rows:
        table.add_row(str(r["type"]), str(r["steps"]), _num(r["critical mean (ms)"]), _num(r["transfer mean (ms)"]),
                      f"rank {r['gating rank']}", _pct(r["gating share"]), str(r["top gate"]),
                      _num(r.get("what-if saved mean (ms)")), _pct(r.get("what-if share")))
    return table


CRITICAL_ROWS = 20  # steps listed in the terminal; the JSON, CSV and HTML hold every step


def _critical_path(rows: Rows) -> Table:
    # the longest first (a missing length last), steps of equal length in their order
    shown = sorted(rows, key=lambda r: (_missing(r["critical (ms)"]),
                                        0.0 if _missing(r["critical (ms)"]) else -r["critical (ms)"]))[:CRITICAL_ROWS]
    caption = None if len(rows) <= CRITICAL_ROWS else f"the {CRITICAL_ROWS} longest of {len(rows):,} steps"
    table = _new(TITLES["critical_path"], "step", "type", "critical (ms)", "collectives", "gating rank", "gate",
                 "gate (ms)", "what-if saved (ms)", text=2, caption=caption)
    for r in shown:
        table.add_row(str(r["step"]), str(r["type"]), _num(r["critical (ms)"]), str(r["collectives"]),
                      f"rank {r['gating rank']}", f"{r['gate kind']} on rank {r['gate rank']}: {r['gate']}",
                      _num(r["gate (ms)"]), _num(r.get("what-if saved (ms)")))
    return table


def _cpu_ops(rows: Rows) -> Table:
    table = _new(TITLES["cpu_ops"], "rank", "operator", "calls", "self (ms)", "self share", "total (ms)", text=2,
                 wide=1)
    for r in rows:
        table.add_row(str(r["rank"]), str(r["name"]), _count(r["calls"]), _num(r["self (ms)"]), _pct(r["self share"]),
                      _num(r["total (ms)"]))
    return table


def _cpu_steps(rows: Rows) -> Table:
    table = _new(TITLES["cpu_steps"], "step type", "operator", "steps", "self per step (ms)", "share of step",
                 text=2, wide=1)
    for r in rows:
        table.add_row(str(r["type"]), str(r["name"]), str(r["steps"]), _num(r["self per step (ms)"]),
                      _pct(r["share of step"]))
    return table


def _step_requests(rows: Rows) -> Table:
    """The first steps, each with its requests as `id tokens (GPU ms)`."""
    table = Table(title=TITLES["step_requests"], title_justify="left")
    for column in ("step", "type", "GPU busy (ms)", "requests: id tokens (GPU ms)"):
        table.add_column(column, overflow="fold")
    steps = [(number, list(group)) for number, group in groupby(sorted(rows, key=lambda r: r["step"]),
                                                                 key=lambda r: r["step"])]
    for number, group in steps[:SHOWN_REQUEST_STEPS]:
        first = group[0]
        who = ", ".join(f"{r['request_id']} {r['tokens']}{'p' if r['prefill'] else ''} ({r['request gpu (ms)']:.2f})"
                        for r in group)
        table.add_row(f"#{number}", str(first["type"]), _fixed(first["gpu busy (ms)"], 2), who)
    if len(steps) > SHOWN_REQUEST_STEPS:
        table.caption = f"first {SHOWN_REQUEST_STEPS} of {len(steps)} steps; --json or --csv holds them all"
    return table


_BUILDERS = {
    "temporal": _temporal, "idle": _idle, "kernel_types": _kernel_types, "top_kernels": _top_kernels,
    "overlap": _overlap, "launches": _launches, "categories": _categories, "phases": _phases,
    "phase_categories": _phase_categories, "frontend": _frontend, "rank_communication": _rank_communication,
    "step_skew": _step_skew, "step_requests": _step_requests,
    "critical_summary": _critical_summary, "critical_path": _critical_path, "cpu_ops": _cpu_ops,
    "cpu_steps": _cpu_steps,
}


def render_diff(frames: dict[str, pd.DataFrame], a: str, b: str, fit: bool = True) -> RenderableType:
    """Diff tables (from `diff.diff_reports`) with A's and B's figures and B's change; `fit` as in `render`."""
    from infertrace.analyze.persist import table_records

    tables = {name: table_records(frame) for name, frame in frames.items()}
    parts: list[RenderableType] = [Text(f"A: {a}\nB: {b}", style="bold")]
    if (df := tables.get("phases")) is not None:
        # GPU figures where either capture has them; CPU operators per step where either is CPU-only
        gpu = any(not _missing(r[f"{c} {side}"]) for r in df for c in ("gpu_busy_share", "kernels_per_step")
                  for side in "AB")
        cpu = any(not _missing(r[f"cpu_ops_per_step {side}"]) for r in df for side in "AB")
        table = _new("Step types: A -> B", "step type", "steps", "mean (ms)", "change", "p99 (ms)", "change",
                     *(["GPU busy", "host wait", "kernels/step"] if gpu else []),
                     *(["CPU ops/step", "change"] if cpu else []), "verdict")
        for r in df:
            gpu_cells = [f"{_pct(r['gpu_busy_share A'])} -> {_pct(r['gpu_busy_share B'])}",
                         f"{_pct(r['host_wait_share A'])} -> {_pct(r['host_wait_share B'])}",
                         _pair(r["kernels_per_step A"], r["kernels_per_step B"], 1)]
            cpu_cells = [_pair(r["cpu_ops_per_step A"], r["cpu_ops_per_step B"], 1),
                         _change(r["cpu_ops_per_step change"])]
            table.add_row(r["type"], _pair(r["steps A"], r["steps B"], 0),
                          _pair(r["step_mean (ms) A"], r["step_mean (ms) B"]), _change(r["step_mean (ms) change"]),
                          _pair(r["step_p99 (ms) A"], r["step_p99 (ms) B"]), _change(r["step_p99 (ms) change"]),
                          *(gpu_cells if gpu else []), *(cpu_cells if cpu else []),
                          f"{r['verdict A'] or '–'} -> {r['verdict B'] or '–'}")
        parts.append(table)
    if (df := tables.get("categories")) is not None:
        table = _new("GPU time by kernel category: A -> B", "category", "time (ms)", "change", "share")
        for r in df:
            table.add_row(r["category"], _pair(r["total (ms) A"], r["total (ms) B"]),
                          _change(r["total (ms) change"]), f"{_pct(r['share A'])} -> {_pct(r['share B'])}")
        parts.append(table)
    if (df := tables.get("phase_categories")) is not None:
        table = _new("GPU time per step by category: A -> B", "step type", "category", "per step (ms)", "change",
                     "share", text=2)
        for r in df:
            table.add_row(r["type"], r["category"], _pair(r["per_step (ms) A"], r["per_step (ms) B"]),
                          _change(r["per_step (ms) change"]), f"{_pct(r['share A'])} -> {_pct(r['share B'])}")
        parts.append(table)
    if len(parts) == 1:
        parts.append(Text("Neither capture has step annotations or GPU kernels to compare.", style="dim"))
    return _group(parts, fit)


def _pair(a, b, digits: int | None = None) -> str:
    return f"{'–' if _missing(a) else _num(float(a), digits)} -> {'–' if _missing(b) else _num(float(b), digits)}"


def _change(value) -> Text:
    if _missing(value):
        return Text("–")
    style = "red" if value > 0 else "green" if value < 0 else ""
    return Text(f"{value:+.1f}%", style=style)
