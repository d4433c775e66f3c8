"""`infertrace analyze` on an N-rank capture against one of its ranks alone: wall time and peak memory.

Each rank is the replicated vLLM TP8 B200 trace of `analyze_speed.py` (--size-mb of JSON), its distributedInfo rank
set, written under --dir (never into the repository). The capture is analysed with the cache off, the ranks in
worker processes (--jobs, default one per core) and, with --ray, as Ray tasks on a local cluster of the host's cores.
Peak memory is the analysing process's own peak resident set (VmHWM) and, separately, the largest worker's.

    python benchmarks/analyze_fleet.py --ranks 8 --size-mb 500 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run as `python benchmarks/analyze_fleet.py` too
from benchmarks.analyze_speed import CHILD_ENV, build_trace, machine, versions, with_bytecode  # noqa: E402


def child(trace_dir: str, jobs: str, ray: str) -> dict:
    if ray == "1":
        import ray as ray_module

        ray_module.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    from infertrace.cli import main

    args = ["analyze", trace_dir, "--quiet", "--no-cache"] + (["--jobs", jobs] if jobs != "0" else [])
    main(args + (["--ray", "auto"] if ray == "1" else []), standalone_mode=False)
    status = Path("/proc/self/status").read_text()
    return {"own_mb": int(status.split("VmHWM:")[1].split()[0]) / 1024,
            "worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def copy_as_rank(src: Path, dst: Path, rank: int) -> None:
    """`src` (a trace build_trace wrote: its first line holds everything before the events) with another rank."""
    marker = ', "traceEvents": [\n'
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        head = fin.readline().decode()
        doc = json.loads(head[:-len(marker)] + "}")
        doc["distributedInfo"] = {**doc.get("distributedInfo", {}), "rank": rank}
        fout.write((json.dumps(doc)[:-1] + marker).encode())
        shutil.copyfileobj(fin, fout, 1 << 24)


def measure(trace_dir: Path, jobs: int, ray: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", str(trace_dir), str(jobs), "1" if ray else "0"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=CHILD_ENV or None)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"run failed:\n{done.stderr[-2000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/infertrace-bench/fleet"))
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--size-mb", type=float, default=500, help="JSON per rank, MB (1e6 B)")
    parser.add_argument("--jobs", type=int, default=0, help="worker processes (0: one per core)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ray", action="store_true", help="also time --ray on a local Ray cluster")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    one, many = args.dir / "one", args.dir / f"ranks{args.ranks}"
    for rank in range(args.ranks):
        path = many / f"rank{rank}.json"
        if not path.exists() or path.stat().st_size < args.size_mb * 1e6 * 0.99:
            if rank == 0:
                build_trace(path, args.size_mb, rank=rank)
            else:
                copy_as_rank(many / "rank0.json", path, rank)
    one.mkdir(parents=True, exist_ok=True)
    if not (one / "rank0.json").exists():
        os.link(many / "rank0.json", one / "rank0.json")
    bytecode = with_bytecode()
    cases = [("one rank", one, False), (f"{args.ranks} ranks", many, False)]
    if args.ray:
        cases.append((f"{args.ranks} ranks, --ray (local cluster)", many, True))
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in cases}
    for i in range(args.repeats):
        for name, path, ray in cases:
            result = measure(path, args.jobs, ray)
            runs[name].append(result)
            print(f"run {i + 1} {name}: {result['wall_s']:.2f} s, own {result['own_mb']:.0f} MB, "
                  f"largest worker {result['worker_mb']:.0f} MB", file=sys.stderr)
    print(f"machine: {machine()}; {versions()}")
    print(f"capture: {args.ranks} ranks x {args.size_mb:g} MB of JSON under {args.dir}")
    if bytecode:
        print(bytecode)
    print(f"command: python benchmarks/analyze_fleet.py --ranks {args.ranks} --size-mb {args.size_mb:g} "
          f"--repeats {args.repeats}{' --ray' if args.ray else ''}")
    print("| | wall time, median (each run) | analysing process peak | largest worker peak |")
    print("|---|---|---|---|")
    base = statistics.median(r["wall_s"] for r in runs["one rank"])
    for name, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        each = ", ".join(f"{r['wall_s']:.2f}" for r in rs)
        print(f"| {name} | {wall:.2f} s ({each}); {wall / base:.2f}x one rank | "
              f"{statistics.median(r['own_mb'] for r in rs):,.0f} MB | "
              f"{statistics.median(r['worker_mb'] for r in rs):,.0f} MB |")


if __name__ == "__main__":
    main()
