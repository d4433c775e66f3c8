#!/usr/bin/env bash
# Where `infertrace analyze` spends its time on this host: interpreter and import costs, file reading, page faults,
# and cProfile of a cold (one process) and a cached run over the 523 MB replicated rank of analyze_speed.py.
#   bash benchmarks/analyze_profile.sh [TRACE_DIR]
set -u
export T=${1:-/tmp/infertrace-bench/vllm_b200_x}
if [ ! -s "$T/trace.json" ]; then
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import analyze_speed as a; from pathlib import Path; \
print(a.build_trace(Path('$T/trace.json'), 520))" || exit 1
fi
echo "cores $(nproc); $(python3 -V); load $(cut -d' ' -f1-3 /proc/loadavg)"
for i in 1 2; do
  for what in pass "import numpy" "import pandas" "import infertrace.analyze.fleet, infertrace.cli"; do
    /usr/bin/time -f "%e s  python3 -c '$what'" python3 -c "$what"
  done
done
/usr/bin/time -f "%e s  cat trace.json (page cache)" cat "$T/trace.json" > /dev/null
python3 - <<'PY'
import os, time, numpy as np
for n in (1, 2):
    t = time.perf_counter(); a = np.ones(500_000_000, np.uint8); t1 = time.perf_counter()
    b = a.copy(); t2 = time.perf_counter()
    print(f"500 MB: first touch {t1 - t:.3f} s, copy into fresh pages {t2 - t1:.3f} s")
    del a, b
t = time.perf_counter(); data = open(os.environ["T"] + "/trace.json", "rb").read(); t1 = time.perf_counter()
print(f"read() the trace into bytes: {t1 - t:.3f} s")
PY
C=$(mktemp -d)
python3 -m infertrace analyze "$T" --quiet --cache-dir "$C" > /dev/null
runs() {
  for jobs in 1 2 4 8 16; do
    /usr/bin/time -f "%e s  %M KB  analyze --no-cache --jobs $jobs" python3 -m infertrace analyze "$T" --quiet --no-cache --jobs $jobs 2>&1 >/dev/null | grep -v "^note"
  done
  for i in 1 2; do /usr/bin/time -f "%e s  %M KB  analyze, cached" python3 -m infertrace analyze "$T" --quiet --cache-dir "$C" 2>&1 >/dev/null | grep -v "^note"; done
}
echo "--- PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset}; as installed"; runs
# what `pip install` leaves: every module compiled to bytecode once
python3 -m compileall -q -j 0 infertrace $(python3 -c "import sys; print(' '.join(p for p in sys.path if p.startswith('/tmp/site')))") > /dev/null
echo "--- after compileall"; runs
python3 -X importtime -m infertrace analyze "$T" --quiet --cache-dir "$C" 2> /tmp/imp.txt > /dev/null
echo "--- cached run, slowest imports (cumulative us)"; sort -t'|' -k2 -n /tmp/imp.txt | tail -12
echo "--- cached run, cProfile"; python3 -m cProfile -s cumtime -m infertrace analyze "$T" --quiet --cache-dir "$C" 2>&1 | head -45
echo "--- cold run, one process, cProfile"
python3 -m cProfile -s tottime -m infertrace analyze "$T" --quiet --no-cache --jobs 1 2>&1 | head -40
rm -rf "$C"
