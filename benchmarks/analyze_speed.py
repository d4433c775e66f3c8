"""`infertrace analyze` against HTA (traceinsight) on one large rank: our command with every analysis, cold and from
its cache, against HTA's parse alone with its default loader and with its fastest (ijson, yajl2_c backend).

The trace is made by replicating the real events of TraceLens' vLLM TP8 B200 capture (shifted in time, with
fresh correlation and external ids) until it reaches --size-mb of JSON; it is written under /tmp, never into
the repository. Each measurement runs in a fresh Python process, one at a time, the tools alternating. Wall time is
measured around the whole process (interpreter start and imports included); peak memory is the process's own peak
resident set (VmHWM) plus, where it started worker processes, the largest of theirs (a forked process's resident
set counts the pages it shares with its parent, so this overstates what the two use together).

    python benchmarks/analyze_speed.py --size-mb 520 --repeats 2
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1].parent / "shared/traces/tracelens/vllm_tp8_b200_rank0/eager_trace.json.gz"
DEFAULT_TRACE = Path("/tmp/infertrace-bench/vllm_b200_x/trace.json")
TOOLS = ("hta", "hta_fast", "ours", "ours_jobs", "ours_cached", "ours_imports")  # ours_jobs: one run per --jobs N
LABELS = {
    "hta": "traceinsight 0.6.1 `TraceAnalysis(trace_dir)`, default loader (parse only)",
    "hta_fast": "traceinsight 0.6.1, `ParserBackend.IJSON_BATCH_AND_COMPRESS` (parse only)",
    "ours": "`infertrace analyze DIR --quiet --no-cache` (parse + every analysis)",
    "ours_cached": "`infertrace analyze DIR --quiet`, second run (the report from the cache)",
    "ours_imports": "the imports of a run that reads the ranks from the cache (--csv, --html), alone",
}


def build_trace(out: Path, size_mb: float, rank: int | None = None) -> dict:
    doc = json.loads(gzip.decompress(SOURCE.read_bytes()))
    if rank is not None:
        doc["distributedInfo"] = {**doc.get("distributedInfo", {}), "rank": rank}
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


def _peaks() -> dict:
    status = Path("/proc/self/status").read_text()
    own = int(status.split("VmHWM:")[1].split()[0]) / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"own_mb": own, "children_mb": children}


def child_hta(trace_dir: str, fast: bool) -> dict:
    import logging

    from hta.common.trace_parser import ParserBackend, set_default_trace_parsing_backend
    from hta.trace_analysis import TraceAnalysis

    logging.getLogger("hta").setLevel(logging.ERROR)
    if fast:
        import ijson

        assert "yajl2_c" in ijson.backend, ijson.backend
        set_default_trace_parsing_backend(ParserBackend.IJSON_BATCH_AND_COMPRESS)
    analysis = TraceAnalysis(trace_dir=trace_dir)
    out = _peaks()
    frame = analysis.t.get_trace(0)
    kernels = frame[frame["cat"] == analysis.t.symbol_table.get_sym_id_map()["kernel"]]
    return {**out, "kernels": len(kernels), "kernel_us": float(kernels["dur"].sum())}


def child_ours(trace_dir: str, cache_dir: str | None, extra: tuple[str, ...] = ()) -> dict:
    from infertrace.cli import main

    args = ["analyze", trace_dir, "--quiet", *extra] + (["--cache-dir", cache_dir] if cache_dir else ["--no-cache"])
    main(args, standalone_mode=False)
    return _peaks()


def child_imports() -> dict:
    """What a run that reads every rank from the cache (--csv, --html, --perfetto) imports before reading: the CLI
    and the analysis modules, as `analyze run` imports them (pandas with pyarrow hidden). A run that prints the
    cached report imports none of pandas, numpy and the analyses."""
    import infertrace.analyze.fleet  # noqa: F401
    from infertrace.analyze.command import import_pandas_without_pyarrow
    from infertrace.cli import main  # noqa: F401

    import_pandas_without_pyarrow()
    import infertrace.analyze.render  # noqa: F401
    import infertrace.analyze.report  # noqa: F401

    return _peaks()


def child_exact(trace_dir: str) -> dict:
    from infertrace.analyze import load_capture

    events = load_capture(trace_dir).ranks[0].events
    kernels = events[events["kind"] == "kernel"]
    return {"kernels": len(kernels), "kernel_ns": int(kernels["dur_ns"].sum())}


def _tree_pss(root: int) -> tuple[float, float, int]:
    """Proportional set size of `root` and every process below it, in MB: a page shared by n of them counts 1/n to
    each, so pages a forked worker shares with its parent are counted once (peak RSS summed counts them twice).
    Also `root`'s own share of it (MB) and the processes in the tree."""
    total, own, count, todo = 0, 0, 0, [root]
    while todo:
        pid = todo.pop()
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
            pss = int(rollup.split("\nPss:")[1].split()[0])
            total, count = total + pss, count + 1
            own += pss if pid == root else 0
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue  # the process ended between two reads
    return total / 1024, own / 1024, count


CHILD_ENV: dict[str, str] = {}  # set by with_bytecode(): what every measured process runs with


def with_bytecode() -> str | None:
    """Where this Python writes no bytecode (PYTHONDONTWRITEBYTECODE, as on the GPU host), every measured process
    would compile each module it imports from source, every run: an installed package (pip compiles on install) does
    not. Give the children a bytecode cache of their own (PYTHONPYCACHEPREFIX, under /tmp) and fill it once by
    importing what each tool imports, so both tools are measured as installed. Returns a note, or None if nothing
    was needed."""
    if not (sys.flags.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE")):
        return None
    prefix = Path(tempfile.gettempdir()) / "infertrace-bench-pycache"
    CHILD_ENV.update({k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})
    CHILD_ENV["PYTHONPYCACHEPREFIX"] = str(prefix)
    warm = ("import pandas, numpy, msgspec, infertrace.cli, infertrace.analyze.fleet, infertrace.analyze.command, "
            "infertrace.analyze.report, infertrace.analyze.render, infertrace.analyze.html\n"
            "try:\n import hta.trace_analysis, ijson\nexcept ImportError:\n pass")
    subprocess.run([sys.executable, "-c", warm], env=CHILD_ENV, check=True)
    return f"this Python writes no bytecode: the tools run with a filled bytecode cache at {prefix}"


def measure(tool: str, trace_dir: Path, extra: list[str] | None = None, env: dict | None = None) -> dict:
    """One run of `tool` in a fresh process: its wall time, its peak RSS (with its largest worker's, for ours), and
    the peak of its process tree's summed PSS, sampled every 20 ms by a thread of this process."""
    cmd = [sys.executable, __file__, "--child", tool, str(trace_dir), *(extra or [])]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**(CHILD_ENV or os.environ), **(env or {})})
    pss = [(0.0, 0.0, 0)]  # at the peak: the tree's PSS, the measured process's own, the processes

    def sample() -> None:
        while proc.poll() is None:
            pss[0] = max(pss[0], _tree_pss(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{tool} run failed:\n{stderr[-2000:]}")
    out = json.loads(stdout.strip().splitlines()[-1])
    out["wall_s"] = wall
    out["peak_mb"] = out["own_mb"] + (out["children_mb"] if tool.startswith("ours") else 0.0)
    out["pss_peak_mb"], out["pss_peak_own_mb"], out["pss_peak_processes"] = pss[0]
    return out


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
           f"{platform.python_version()}, load average {os.getloadavg()[0]:.1f} at start"


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in ("traceinsight", "ijson", "pandas", "numpy", "msgspec", "pyarrow"):
        try:
            out.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            out.append(f"{pkg} (absent)")
    return ", ".join(out)


def _has_ijson() -> bool:
    try:
        import ijson
    except ImportError:
        return False
    return "yajl2_c" in ijson.backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="where the replicated trace is written")
    parser.add_argument("--size-mb", type=float, default=520, help="size of the replicated trace in MB (1e6 B)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each tool, alternating")
    parser.add_argument("--jobs", default="2", help="also run `infertrace analyze --jobs N` for each N listed")
    parser.add_argument("--child", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        tool, trace_dir, *rest = args.child
        result = {"hta": lambda: child_hta(trace_dir, False), "hta_fast": lambda: child_hta(trace_dir, True),
                  "ours": lambda: child_ours(trace_dir, None),
                  "ours_cached": lambda: child_ours(trace_dir, rest[0]),
                  "ours_imports": child_imports,
                  "exact": lambda: {**child_exact(trace_dir), "own_mb": 0, "children_mb": 0}}.get(
            tool, lambda: child_ours(trace_dir, None, ("--jobs", tool.removeprefix("ours_jobs"))))()
        print(json.dumps(result))
        return
    if not args.trace.exists() or args.trace.stat().st_size < args.size_mb * 1e6 * 0.99:
        info = build_trace(args.trace, args.size_mb)
        print(f"built {args.trace}: {info['events']:,} events ({info['copies']} copies), {info['bytes']:,} bytes",
              file=sys.stderr)
    with open(args.trace, "rb") as fh:  # warm the page cache so no tool pays for the first read
        while fh.read(1 << 24):
            pass
    jobs = [f"ours_jobs{int(n)}" for n in args.jobs.split(",") if n]
    for tool in jobs:
        LABELS[tool] = (f"`infertrace analyze DIR --quiet --no-cache --jobs {tool.removeprefix('ours_jobs')}` "
                        f"(the same, the trace decoded in that many processes)")
    tools = [u for t in TOOLS if t != "hta_fast" or _has_ijson() for u in (jobs if t == "ours_jobs" else [t])]
    if "hta_fast" not in tools:
        print("ijson with the yajl2_c backend is not installed (pip install ijson): the fastest HTA loader is left "
              "out", file=sys.stderr)
    bytecode = with_bytecode()
    cache = Path(tempfile.mkdtemp(prefix="infertrace-bench-cache-"))
    try:
        measure("ours_cached", args.trace.parent, [str(cache)])  # fills the cache
        runs: dict[str, list[dict]] = {t: [] for t in tools}
        for i in range(args.repeats):
            for tool in tools:
                result = measure(tool, args.trace.parent, [str(cache)] if tool == "ours_cached" else None)
                runs[tool].append(result)
                print(f"run {i + 1} {tool}: {result['wall_s']:.2f} s, {result['peak_mb']:.0f} MB", file=sys.stderr)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    exact = measure("exact", args.trace.parent)
    hta_exact = measure("hta", args.trace.parent, env={"HTA_DISABLE_NS_ROUNDING": "1"})
    med = {t: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "peak_mb", "pss_peak_mb")}
           for t, rs in runs.items()}
    size = args.trace.stat().st_size
    print(f"machine: {machine()}; {versions()}")
    print(f"trace: {args.trace} ({size / 1e6:.0f} MB of JSON, one rank)")
    if bytecode:
        print(bytecode)
    print(f"command: python benchmarks/analyze_speed.py --size-mb {args.size_mb:g} --repeats {args.repeats} "
          f"--jobs {args.jobs}")
    print(f"| | wall time, median of {args.repeats} (each run) | peak RSS, median (each run) | "
          f"peak PSS of the process tree, sampled (each run) |")
    print("|---|---|---|---|")
    for tool in tools:
        walls = ", ".join(f"{r['wall_s']:.2f}" for r in runs[tool])
        peaks = ", ".join(f"{r['peak_mb']:,.0f}" for r in runs[tool])
        psss = ", ".join(f"{r['pss_peak_mb']:,.0f}" for r in runs[tool])
        print(f"| {LABELS[tool]} | {med[tool]['wall_s']:.2f} s ({walls}) | {med[tool]['peak_mb']:,.0f} MB ({peaks}) | "
              f"{med[tool]['pss_peak_mb']:,.0f} MB ({psss}) |")
    for base in ("hta_fast", "hta"):
        if base in med:
            for ours in ("ours", *jobs, "ours_cached"):
                print(f"| {ours} against {base} | {med[base]['wall_s'] / med[ours]['wall_s']:.1f}x faster | "
                      f"{med[ours]['peak_mb'] / med[base]['peak_mb']:.2f}x the peak RSS, "
                      f"{med[ours]['pss_peak_mb'] / med[base]['pss_peak_mb']:.2f}x by PSS |")
    for tool in tools:  # where each run's peak came: the measured process's share, and how many were alive
        if tool.startswith("ours"):
            print(f"at the PSS peak, {tool}: " + ", ".join(
                f"{r['pss_peak_own_mb']:,.0f} of {r['pss_peak_mb']:,.0f} MB in the analysing process, "
                f"{r['pss_peak_processes']} process(es)" for r in runs[tool]))
    hta = runs["hta"][0]
    print(f"kernels: ours {exact['kernels']:,}, HTA {hta['kernels']:,}, HTA without ns rounding "
          f"{hta_exact['kernels']:,}")
    print(f"kernel time (us): ours {exact['kernel_ns'] / 1000:,.3f} (integer ns); HTA without ns rounding "
          f"{hta_exact['kernel_us']:,.3f}; HTA default (rounds each kernel inwards to whole us) {hta['kernel_us']:,.3f}")
    print("all runs: " + json.dumps(runs))


if __name__ == "__main__":
    main()
