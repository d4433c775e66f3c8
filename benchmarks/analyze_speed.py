"""`infertrace analyze` against HTA on a large trace: parse plus every analysis here, HTA's parse alone there.

The trace is made by replicating the real events of TraceLens' vLLM TP8 B200 capture (shifted in time, with
fresh correlation and external ids) until it reaches --size-mb of JSON; it is written under /tmp, never into
the repository. Each measurement runs in a fresh Python process, one at a time, alternating the two tools; a
process reports its own wall time (imports included) and peak resident memory (ru_maxrss).

    python benchmarks/analyze_speed.py --size-mb 520 --repeats 3
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1].parent / "shared/traces/tracelens/vllm_tp8_b200_rank0/eager_trace.json.gz"
DEFAULT_TRACE = Path("/tmp/infertrace-bench/vllm_b200_x/trace.json")


def build_trace(out: Path, size_mb: float) -> dict:
    doc = json.loads(gzip.decompress(SOURCE.read_bytes()))
    events = doc.pop("traceEvents")
    timed = [e for e in events if "ts" in e]
    span = max(e["ts"] + e.get("dur", 0) for e in timed) - min(e["ts"] for e in timed) + 1000.0
    next_corr = 1 + max(max((e.get("args") or {}).get("correlation", 0) for e in events),
                        max(e["id"] for e in events if isinstance(e.get("id"), int)))
    next_ext = 1 + max((e.get("args") or {}).get("External id", 0) for e in events)
    out.parent.mkdir(parents=True, exist_ok=True)
    target, written, copies = size_mb * 1e6, 0, 0
    with open(out, "w") as fh:
        head = json.dumps(doc)[:-1] + ', "traceEvents": [\n'
        fh.write(head)
        written += len(head)
        while written < target:
            lines = []
            for e in events:
                e = dict(e)
                if "ts" in e:
                    e["ts"] = round(e["ts"] + copies * span, 3)
                if isinstance(e.get("id"), int):
                    e["id"] += copies * next_corr
                if e.get("args"):
                    args = dict(e["args"])
                    if "correlation" in args:
                        args["correlation"] += copies * next_corr
                    if "External id" in args:
                        args["External id"] += copies * next_ext
                    e["args"] = args
                lines.append("  " + json.dumps(e))
            chunk = ("" if copies == 0 else ",\n") + ",\n".join(lines)
            fh.write(chunk)
            written += len(chunk)
            copies += 1
        fh.write("\n]}\n")
    return {"copies": copies, "events": copies * len(events), "bytes": out.stat().st_size}


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_hta(trace_dir: str) -> dict:
    start = time.perf_counter()
    import logging

    from hta.trace_analysis import TraceAnalysis

    logging.getLogger("hta").setLevel(logging.ERROR)
    analysis = TraceAnalysis(trace_dir=trace_dir)
    wall, peak = time.perf_counter() - start, _peak_mb()
    frame = analysis.t.get_trace(0)
    kernels = frame[frame["cat"] == analysis.t.symbol_table.get_sym_id_map()["kernel"]]
    return {"wall_s": wall, "max_rss_mb": peak, "kernels": len(kernels),
            "kernel_us": float(kernels["dur"].sum())}


def child_ours(trace_dir: str) -> dict:
    start = time.perf_counter()
    from infertrace.analyze import build_report, load_capture

    capture = load_capture(trace_dir)
    report = build_report(capture)
    wall, peak = time.perf_counter() - start, _peak_mb()
    assert not report.skipped, report.skipped
    events = capture.ranks[0].events
    kernels = events[events["kind"] == "kernel"]
    return {"wall_s": wall, "max_rss_mb": peak, "kernels": len(kernels),
            "kernel_us": int(kernels["dur_ns"].sum()) / 1000.0}


def measure(tool: str, trace_dir: Path, env: dict | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", tool, str(trace_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tool} run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> str:
    model = ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} CPU cores ({model or platform.processor()}), {mem_gb:.0f} GiB RAM, Python " \
           f"{platform.python_version()}"


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in ("HolisticTraceAnalysis", "pandas", "numpy", "msgspec"):
        try:
            out.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            out.append(f"{pkg} (absent)")
    return ", ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="where the replicated trace is written")
    parser.add_argument("--size-mb", type=float, default=520, help="size of the replicated trace in MB (1e6 B)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each tool, alternating")
    parser.add_argument("--child", nargs=2, metavar=("TOOL", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps({"hta": child_hta, "ours": child_ours}[args.child[0]](args.child[1])))
        return
    if not args.trace.exists() or args.trace.stat().st_size < args.size_mb * 1e6 * 0.99:
        info = build_trace(args.trace, args.size_mb)
        print(f"built {args.trace}: {info['events']:,} events ({info['copies']} copies), {info['bytes']:,} bytes",
              file=sys.stderr)
    with open(args.trace, "rb") as fh:  # warm the page cache so neither tool pays for the first read
        while fh.read(1 << 24):
            pass
    runs: dict[str, list[dict]] = {"hta": [], "ours": []}
    for i in range(args.repeats):
        for tool in ("hta", "ours"):
            result = measure(tool, args.trace.parent)
            runs[tool].append(result)
            print(f"run {i + 1} {tool}: {result['wall_s']:.2f} s, {result['max_rss_mb']:.0f} MB", file=sys.stderr)
    exact = measure("hta", args.trace.parent, {"HTA_DISABLE_NS_ROUNDING": "1"})
    med = {tool: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "max_rss_mb")}
           for tool, rs in runs.items()}
    size = args.trace.stat().st_size
    print(f"machine: {machine()}; {versions()}")
    print(f"trace: {args.trace} ({size / 1e6:.0f} MB of JSON)")
    print(f"command: python benchmarks/analyze_speed.py --size-mb {args.size_mb:g} --repeats {args.repeats}")
    print(f"| | wall time (median of {args.repeats}) | peak RSS (median) |")
    print("|---|---|---|")
    print(f"| HTA 0.5.0 `TraceAnalysis(trace_dir)` (parse only) | {med['hta']['wall_s']:.1f} s | "
          f"{med['hta']['max_rss_mb']:,.0f} MB |")
    print(f"| `infertrace analyze` load + all analyses | {med['ours']['wall_s']:.1f} s | "
          f"{med['ours']['max_rss_mb']:,.0f} MB |")
    print(f"| ratio | {med['hta']['wall_s'] / med['ours']['wall_s']:.1f}x faster | "
          f"{med['ours']['max_rss_mb'] / med['hta']['max_rss_mb']:.2f}x the memory |")
    ours, hta = runs["ours"][0], runs["hta"][0]
    print(f"kernels: ours {ours['kernels']:,}, HTA {hta['kernels']:,}, HTA without ns rounding {exact['kernels']:,}")
    print(f"kernel time (us): ours {ours['kernel_us']:,.3f}; HTA without ns rounding {exact['kernel_us']:,.3f}; "
          f"HTA default (rounds each kernel inwards to whole us) {hta['kernel_us']:,.3f}")
    print("all runs: " + json.dumps(runs))


if __name__ == "__main__":
    main()
