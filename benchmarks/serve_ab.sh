#!/usr/bin/env bash
# `serve` under `bench`: a git revision (BASE, default HEAD) against the working tree, alternated on one machine, so
# that a change to the engine or the server is measured beside its baseline in the same call. Each run is one
# server of one tree under request_log_serve.sh's loads with the request log on: an open loop at RATE req/s (its
# requests joined to the server's log, so TTFT comes split into parts) and a closed loop at SAT_CONCURRENCY streams.
# TREES orders the runs ("new base new base" by default); BUDGET_S stops starting runs once less than a run's time
# is left. Prints each run's table; the runs stay in OUTDIR/N-TREE.
#
#   bash benchmarks/serve_ab.sh [PRESET] [OUTDIR]
#   (env: BASE, TREES, BUDGET_S, and request_log_serve.sh's PORT, RATE, NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN,
#    SAT_CONCURRENCY, SAT_PROMPTS)
#   e.g. the landed code against a change, 60 req/s and 256 streams: BASE=origin/main bash benchmarks/serve_ab.sh
set -euo pipefail
preset=${1:-qwen3-0.6b}
out=${2:-/tmp/serve_ab}
here=$(cd "$(dirname "$0")" && pwd)
work=$(cd "$here/.." && pwd)
source "$here/serve_lib.sh"
mkdir -p "$out"
base_rev=$(git -C "$work" rev-parse --short "${BASE:-HEAD}")
base="$out/base-$base_rev"
[ -d "$base" ] || { mkdir -p "$base" && git -C "$work" archive "$base_rev" | tar -x -C "$base"; }
model=$(model_of "$preset" "$out")
stamp "base $base_rev in $base; new: the working tree of $work ($(git -C "$work" status --short | wc -l) paths changed)"
started=$(date +%s)
i=0
for tree in ${TREES:-new base new base}; do
  i=$((i + 1))
  dir=$work; [ "$tree" = base ] && dir=$base
  run="$out/$i-$tree"
  mkdir -p "$run"
  ln -sfn "$model" "$run/$preset"  # request_log_serve.sh finds the model made once
  if [ -n "${BUDGET_S:-}" ] && [ $((BUDGET_S - ($(date +%s) - started))) -lt 90 ]; then
    stamp "run $i ($tree) not started: under 90 s of BUDGET_S left"; continue
  fi
  stamp "run $i: $tree"
  (cd "$dir" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" ORDER=on PORT=$((${PORT:-8000} + i)) \
    bash benchmarks/request_log_serve.sh "$preset" "$run") >"$run/summary.txt" 2>&1 || stamp "run $i failed: $run/summary.txt"
  sed -n '/^run /,$p' "$run/summary.txt"
done
