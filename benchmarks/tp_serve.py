"""The figures of benchmarks/tp_serve.sh: HTA's own communication/computation overlap on a capture's rank files, and
the run's one table and summary.json.

    python3 benchmarks/tp_serve.py hta CAPTURE_DIR ANALYSIS_JSON OUT_JSON
        HTA (traceinsight) on the very files `infertrace analyze` read (ANALYSIS_JSON's ranks), given to
        TraceAnalysis by rank: its get_comm_comp_overlap, and the time of the kernels its own classification
        (hta.utils.utils.get_kernel_type) calls communication, per rank.
    python3 benchmarks/tp_serve.py figures RESULT_JSON
        One line of a bench result's headline figures, printed as soon as the run ends (a run cut short later keeps
        them in its log).
    python3 benchmarks/tp_serve.py summary OUTDIR PRESET
        Reads OUTDIR's results (tp{N}-rate.json, tp{N}-streams.json, server-tp{N}.json, analysis-tp2.json,
        hta-tp2.json, failures.txt), prints the tables and writes OUTDIR/summary.json.

HTA is given the rank files by name, not the capture folder: in a folder written by `infertrace serve`, HTA's
folder scan (hta.common.trace_file) also takes the capture's manifest and request log for traces, and maps a file
without a rank to rank 0, in place of rank 0's trace.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

FIGURES = (  # (bench result key, column, format)
    ("output_throughput", "out tok/s", ",.0f"),
    ("median_ttft_ms", "TTFT p50", ".1f"),
    ("p99_ttft_ms", "TTFT p99", ".1f"),
    ("median_tpot_ms", "TPOT p50", ".2f"),
    ("p99_itl_ms", "ITL p99", ".1f"),
)
LOADS = ("rate", "streams")


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def hta(capture_dir: Path, analysis_json: Path, out_json: Path) -> int:
    analysis = _read(analysis_json)
    if analysis is None:
        out_json.write_text(json.dumps({"error": f"no analysis at {analysis_json}"}))
        print(f"hta: no analysis at {analysis_json}", file=sys.stderr)
        return 1
    files = {}
    for row in analysis["ranks"]:
        found = sorted(capture_dir.rglob(row["file"]))
        if found:
            files[int(row["rank"])] = str(found[0])
    result: dict = {"trace_files": files}
    try:
        import logging

        from hta.trace_analysis import TraceAnalysis
        from hta.utils.utils import get_kernel_type

        logging.getLogger("hta").setLevel(logging.ERROR)
        result["workaround"] = _widen_correlation_ids()
        t0 = time.perf_counter()
        analysis_hta = TraceAnalysis(trace_files=files, trace_dir=str(capture_dir))
        result["load_s"] = time.perf_counter() - t0
        overlap = analysis_hta.get_comm_comp_overlap(visualize=False)
        result["comm_comp_overlap"] = {int(r["rank"]): _num(r["comp_comm_overlap_pctg"])
                                       for _, r in overlap.iterrows()}
        symbols = analysis_hta.t.symbol_table.get_sym_table()
        per_rank = {}
        for rank, frame in analysis_hta.t.traces.items():
            gpu = frame[frame["stream"].ne(-1)]
            kinds = gpu["name"].map(lambda i: get_kernel_type(symbols[i]))
            comm = gpu[kinds.eq("COMMUNICATION").to_numpy()]
            names = comm["name"].map(lambda i: symbols[i])
            per_rank[int(rank)] = {"comm_us": float(comm["dur"].sum()), "comm_kernels": int(len(comm)),
                                   "comm_names": sorted({n.split("(")[0][:48] for n in names}),
                                   "gpu_kernels": int(len(gpu))}
        result["communication"] = per_rank
        result["ours_with_hta_kernel_types"] = _ours_with_hta_kernel_types(files)
    except Exception as e:  # noqa: BLE001 - HTA's failure is a line in the table, not the end of the run
        result["error"] = f"{type(e).__name__}: {e}"[:500]
    out_json.write_text(json.dumps(result, indent=1))
    if "error" in result:
        print(f"hta: {result['error']}", file=sys.stderr)
        return 1
    return 0


def _ours_with_hta_kernel_types(files: dict[int, str]) -> dict:
    """infertrace's own loader and overlap on the same rank files, with each kernel typed by HTA's classifier as it
    stands (only nccl-named kernels are communication), so the figure is comparable with HTA's to the last digit."""
    from hta.utils.utils import get_kernel_type

    from infertrace.analyze import breakdown
    from infertrace.analyze.capture import load_capture

    events = {rank: load_capture(Path(path)).ranks[0].events for rank, path in files.items()}
    trim = len(breakdown.profiler_step_names(list(events.values()))) >= 2
    exact, floored = {}, {}
    for rank, e in events.items():
        g = breakdown.classified_gpu_work(e, trim)
        g["kernel_type"] = g["name"].astype(str).map(get_kernel_type)
        exact[rank] = g
        # HTA's loader floors each event's start and duration to whole microseconds
        f = g.copy()
        f["ts_ns"] = f["ts_ns"] // 1000 * 1000
        f["dur_ns"] = f["dur_ns"] // 1000 * 1000
        f["end_ns"] = f["ts_ns"] + f["dur_ns"]
        floored[rank] = f
    result = {}
    for label, gpu in (("ns", exact), ("floored_to_us", floored)):
        for _, r in breakdown.comm_comp_overlap(gpu).iterrows():
            result.setdefault(int(r["rank"]), {})[label] = {"comm_us": float(r["comm_time(us)"]),
                                                           "overlap_pctg": _num(r["comp_comm_overlap_pctg"])}
    return result


def _widen_correlation_ids() -> str:
    """HTA 0.6.1's `transform_correlation_to_index` writes row numbers into a column made from `correlation`, whose
    dtype its loader has narrowed to fit the ids: int16 in a capture whose ids stay under 32,768 (a server capture
    of CUDA-graph replays launches few kernels). Past 32,767 events pandas 3 refuses the write ("Invalid value ... for
    dtype 'int16'"; pandas 2 widened it with a warning), and the whole load fails. The ids are widened first, which
    changes nothing else; the pool HTA parses ranks in is forked, so it inherits this."""
    import hta.common.trace as trace

    original = trace.transform_correlation_to_index

    def widened(df, symbol_table):
        if "correlation" in df.columns:
            df["correlation"] = df["correlation"].astype("int64")
        return original(df, symbol_table)

    trace.transform_correlation_to_index = widened
    return "correlation ids widened to int64 before HTA's transform_correlation_to_index (its int16 column fails under pandas 3)"


def _num(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if value != value else value


def _fmt(value, spec: str, width: int) -> str:
    return f"{'':>{width}}" if value is None else f"{format(value, spec):>{width}}"


def summary(out: Path, preset: str) -> dict:
    lines: list[str] = []
    say = lines.append
    summary: dict = {"preset": preset, "runs": {}, "servers": {}, "failures": []}
    meta = _read(out / "meta.json") or {}
    summary.update(meta)
    failures = out / "failures.txt"
    if failures.exists():
        summary["failures"] = [ln for ln in failures.read_text().splitlines() if ln.strip()]

    say(f"\n{preset}, {meta.get('input_len', 512)} in / {meta.get('output_len', 128)} out, random tokens, "
        f"ignore_eos; {meta.get('device', 'device unknown')}")
    head = "".join(f"{col:>11}" for _, col, _ in FIGURES)
    say(f"{'TP':<4}{'load':<13}{head}{'x TP1':>7}{'done/failed':>13}  (ms for latencies)")
    base = {}
    tps = sorted({int(p.stem[2:].split("-")[0]) for p in out.glob("tp*-*.json") if p.stem[2:].split("-")[0].isdigit()}
                 | {int(p.stem[9:]) for p in out.glob("server-tp*.json") if p.stem[9:].isdigit()})
    for tp in tps:
        summary["runs"][f"tp{tp}"] = {}
        for load in LOADS:
            label = f"{meta.get('rate', 60):g} req/s" if load == "rate" else f"{meta.get('streams', 256)} streams"
            r = _read(out / f"tp{tp}-{load}.json")
            if r is None:
                say(f"{'TP' + str(tp):<4}{label:<13}{'no result':>11}")
                continue
            r = r.get("runs", [r])[0]
            picked = {k: r.get(k) for k, _, _ in FIGURES}
            picked |= {k: r.get(k) for k in ("completed", "failed", "duration", "request_rate", "max_concurrency",
                                             "num_prompts", "headroom_warnings", "steady_output_throughput")}
            summary["runs"][f"tp{tp}"][load] = picked
            tok = r.get("output_throughput")
            if tp == 1:
                base[load] = tok
            ratio = tok / base[load] if base.get(load) and tok else None
            row = "".join(_fmt(r.get(k), spec, 11) for k, _, spec in FIGURES)
            done = f"{r.get('completed', '?')}/{r.get('failed', '?')}"
            say(f"{'TP' + str(tp):<4}{label:<13}{row}{_fmt(ratio, '.2f', 7)}{done:>13}")
            for warning in r.get("headroom_warnings") or []:
                say(f"    client: {warning}")
    for tp in tps:
        s = _read(out / f"server-tp{tp}.json")
        if s is None:
            continue
        summary["servers"][f"tp{tp}"] = s
        exited = (f"exit {s['exit_s']:.2f} s after SIGTERM (status {s.get('exit_code')})"
                  if s.get("exit_s") is not None else "no exit within 20 s of SIGTERM: SIGKILL")
        if s.get("exited_by_itself"):
            exited = f"EXITED BY ITSELF during the run (status {s.get('exit_code')})"
        gone = (f"every process of it gone after {s['all_gone_s']:.2f} s" if s.get("all_gone_s") is not None
                else f"LEFT BEHIND (SIGKILL): {s.get('left_behind')}")
        say(f"server TP{tp}: all-reduce {s.get('all_reduce') or '?'}, ready after {_fmt(s.get('ready_s'), '.1f', 0)} s;"
            f" {exited}, {gone}")

    analysis = _read(out / "analysis-tp2.json")
    hta_result = _read(out / "hta-tp2.json") or {}
    if analysis is not None:
        tables = analysis.get("tables", {})
        keep = ("rank_communication", "step_skew", "critical_summary", "overlap", "phases")
        summary["analysis"] = {k: tables.get(k) for k in keep}
        summary["analysis"]["ranks"] = analysis.get("ranks")
        summary["analysis"]["problems"] = analysis.get("problems")
        _rank_tables(tables, hta_result, say)
    elif "tp2" in summary["runs"]:
        say("\nno analysis of the TP2 capture (see failures)")
    summary["hta"] = hta_result
    if summary["failures"]:
        say("\nFAILURES:")
        lines.extend(f"  {f}" for f in summary["failures"])
    text = "\n".join(lines)
    print(text)
    (out / "table.txt").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"\nall of it: {out / 'summary.json'} (the table: {out / 'table.txt'})")
    return summary


def _rank_tables(tables: dict, hta_result: dict, say) -> None:
    comm = tables.get("rank_communication") or []
    say("\nTP2 capture under load, per rank and step type (infertrace analyze): communication = all-reduce and the "
        "tokens' broadcast")
    say(f"{'rank':<6}{'type':<8}{'steps':>6}{'step ms':>9}{'comm ms':>9}{'share':>8}{'exposed':>9}")
    for r in comm:
        say(f"{r['rank']:<6}{r['type']:<8}{r['steps']:>6}{r['step mean (ms)']:>9.3f}{r['all-reduce mean (ms)']:>9.3f}"
            f"{r['all-reduce share']:>8.1%}{r['exposed share']:>9.1%}")
    overlap = {int(r["rank"]): r for r in tables.get("overlap") or []}
    hta_comm = {int(k): v for k, v in (hta_result.get("communication") or {}).items()}
    hta_overlap = {int(k): v for k, v in (hta_result.get("comm_comp_overlap") or {}).items()}
    say("\nper rank, whole capture: infertrace analyze | HTA (traceinsight) get_comm_comp_overlap on the same files")
    say(f"{'rank':<6}{'steps':>6}{'comm share':>11}{'exposed':>9}{'comm ms':>9}{'overlap':>9}  |"
        f"{'HTA comm ms':>12}{'HTA overlap':>12}  HTA's communication kernels")
    for rank in sorted({int(r["rank"]) for r in comm} | set(overlap) | set(hta_comm)):
        mine = [r for r in comm if int(r["rank"]) == rank]
        steps = sum(r["steps"] for r in mine)
        step_ms = sum(r["steps"] * r["step mean (ms)"] for r in mine)
        comm_ms = sum(r["steps"] * r["all-reduce mean (ms)"] for r in mine)
        exposed_ms = sum(r["steps"] * r["exposed mean (ms)"] for r in mine)
        o = overlap.get(rank, {})
        h = hta_comm.get(rank, {})
        say(f"{rank:<6}{steps:>6}{_fmt(comm_ms / step_ms if step_ms else None, '.1%', 11)}"
            f"{_fmt(exposed_ms / step_ms if step_ms else None, '.1%', 9)}"
            f"{_fmt(o['comm_time(us)'] / 1e3 if o.get('comm_time(us)') is not None else None, '.2f', 9)}"
            f"{_fmt(_pct(o.get('comp_comm_overlap_pctg')), '.1%', 9)}  |"
            f"{_fmt(h['comm_us'] / 1e3 if 'comm_us' in h else None, '.2f', 12)}"
            f"{_fmt(_pct(hta_overlap.get(rank)), '.1%', 12)}  {', '.join(h.get('comm_names', [])[:3])}")
    if hta_result.get("error"):
        say(f"HTA: {hta_result['error']}")
    for rank, both in sorted((hta_result.get("ours_with_hta_kernel_types") or {}).items()):
        ns, us = both.get("ns", {}), both.get("floored_to_us", {})
        say(f"rank {rank}, infertrace with HTA's kernel types: comm {_fmt(ns.get('comm_us'), ',.0f', 0)} us, overlap "
            f"{_fmt(ns.get('overlap_pctg'), '.2f', 0)}% ns-exact; {_fmt(us.get('comm_us'), ',.0f', 0)} us, "
            f"{_fmt(us.get('overlap_pctg'), '.2f', 0)}% with every start and duration floored to us as HTA's loader does")
    say("(infertrace counts torch's symmetric-memory one_shot/two_shot all-reduce kernels as communication; HTA "
        "counts only names starting with nccl)")
    skew = tables.get("step_skew") or []
    for r in skew:
        say(f"step skew {r['type']}: {r['steps']} steps, p50 {r['skew p50 (ms)']:.3f} ms, p99 {r['skew p99 (ms)']:.3f}"
            f" ms, max {r['skew max (ms)']:.3f} ms; rank {r['straggler']} ended last in {r['straggler share']:.0%}")
    for r in tables.get("critical_summary") or []:
        whatif = r.get("what-if saved mean (ms)")
        say(f"critical path {r['type']}: {r['steps']} steps, {r['critical mean (ms)']:.3f} ms a step "
            f"({r['transfer mean (ms)']:.3f} ms in collective transfers); gating rank {r['gating rank']} in "
            f"{r['gating share']:.0%}; top gate {r['top gate'][:100]}"
            + (f"; what-if {whatif:.3f} ms a step ({r['what-if share']:.1%})" if whatif is not None else ""))


def _pct(value) -> float | None:
    value = _num(value)
    return None if value is None else value / 100


def figures(result_json: Path) -> str:
    r = _read(result_json)
    if r is None:
        return f"{result_json.name}: no result"
    cells = ", ".join(f"{col} {_fmt(r.get(key), spec, 0).strip()}" for key, col, spec in FIGURES)
    return f"{result_json.stem}: {cells}; {r.get('completed')} done, {r.get('failed')} failed"


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "figures":
        print(figures(Path(argv[1])))
        return 0
    if len(argv) == 4 and argv[0] == "hta":
        return hta(Path(argv[1]), Path(argv[2]), Path(argv[3]))
    if len(argv) == 3 and argv[0] == "summary":
        summary(Path(argv[1]), argv[2])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
