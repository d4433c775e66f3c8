"""Forked decoding of one large plain Kineto JSON trace: `read_kineto` with one decoding process against N, each
in a fresh process, the counts alternated, the median of the repeats. The trace is synthetic (four events a step,
timestamps as torch 2.x writes them) and written where the first argument says, never into the repository.

    python benchmarks/analyze_split.py /tmp/split.json 520 3 1 2 4 8 16   # TRACE SIZE_MB REPEATS N [N...]
"""

import os
import statistics
import subprocess
import sys
import time


def build(path, size_mb):
    if os.path.exists(path) and os.path.getsize(path) >= size_mb * 1e6:
        return
    t, corr, ext = 1_365_627_862_757.0, 1, 1  # microseconds as torch 2.x writes them (below 2**43: float-exact)
    with open(path, "w") as fh:
        fh.write('{"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "synthetic"}], "traceEvents": [\n')
        written, first = 0, True
        while written < size_mb * 1e6:
            lines = []
            for _ in range(2000):
                lines.append('{"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 100, "tid": 101, '
                             f'"ts": {t:.3f}, "dur": 12.5, "args": {{"External id": {ext}, "Sequence number": {ext}}}}}')
                lines.append('{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 101, '
                             f'"ts": {t + 1:.3f}, "dur": 4.2, "args": {{"External id": {ext}, "correlation": {corr}, "cbid": 211}}}}')
                lines.append('{"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", '
                             f'"pid": 0, "tid": 7, "ts": {t + 6:.3f}, "dur": 20.125, "args": {{"External id": {ext}, '
                             f'"correlation": {corr}, "stream": 7, "device": 0, "grid": [132, 1, 1], "block": [384, 1, 1]}}}}')
                lines.append('{"ph": "X", "cat": "user_annotation", "name": "step[DECODE bs=8]", "pid": 100, "tid": 101, '
                             f'"ts": {t:.3f}, "dur": 30.0, "args": {{}}}}')
                t += 40.0
            corr += 1
            ext += 1
            chunk = ("" if first else ",\n") + ",\n".join(lines)
            first = False
            fh.write(chunk)
            written += len(chunk)
        fh.write("\n]}\n")

ONE = ("import sys, time; t=time.perf_counter(); from infertrace.analyze.kineto import read_kineto; "
       "c = read_kineto(sys.argv[1], workers=int(sys.argv[2])); print(time.perf_counter()-t, len(c))")

def main():
    path, size, repeats, ns = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), [int(n) for n in sys.argv[4:]]
    t = time.perf_counter(); build(path, size)
    print(f"trace {os.path.getsize(path)/1e6:.0f} MB, built in {time.perf_counter()-t:.1f} s; cpus {os.cpu_count()}", flush=True)
    times = {n: [] for n in ns}
    for r in range(repeats):
        for n in ns:
            out = subprocess.run([sys.executable, "-c", ONE, path, str(n)], capture_output=True, text=True, check=True)
            s, events = out.stdout.split()
            times[n].append(float(s))
            print(f"repeat {r} workers {n}: {float(s):.2f} s, {events} events", flush=True)
    for n in ns:
        print(f"workers {n}: median {statistics.median(times[n]):.2f} s  all {[round(x, 2) for x in times[n]]}")

if __name__ == "__main__":
    main()
