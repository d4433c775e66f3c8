#!/usr/bin/env bash
# `infertrace serve` with one and two front ends (--api-server-count), each driven by one and two load processes
# (bench --workers), alternated, at one concurrency: shows whether tokens reaching clients in bursts (ITL median far
# below TPOT) come from the server's front ends or from a load generator near its own limit.
#
#   bash benchmarks/frontends_vs_workers.sh [PRESET] [OUTDIR] [CONCURRENCY]
#   bash benchmarks/frontends_vs_workers.sh qwen3-0.6b /tmp/fvw 256
#   (env: PORT 8000, NUM_PROMPTS 512, INPUT_LEN 256, OUTPUT_LEN 128, ROUNDS 2)
set -euo pipefail
preset=${1:-qwen3-0.6b}
out=${2:-/tmp/fvw}
concurrency=${3:-256}
port=${PORT:-8000}
rounds=${ROUNDS:-2}
mkdir -p "$out"

source "$(dirname "$0")/serve_lib.sh"
model=$(model_of "$preset" "$out")

load=(--base-url "http://127.0.0.1:$port" --tokenizer "$model" --input-len "${INPUT_LEN:-256}"
      --output-len "${OUTPUT_LEN:-128}" --ignore-eos --seed 0 --warmup 8 --num-prompts "${NUM_PROMPTS:-512}"
      --concurrency "$concurrency")
for frontends in 1 2; do
  "${it[@]}" serve --model "$model" --port "$port" --api-server-count "$frontends" >"$out/server-$frontends.log" 2>&1 &
  server=$!
  wait_healthy "$port" "$out/server-$frontends.log"
  for round in $(seq "$rounds"); do
    for workers in 1 2; do
      it bench "${load[@]}" --workers "$workers" --result-json "$out/fe$frontends-w$workers-r$round.json" \
        >"$out/bench.log" 2>&1
    done
  done
  stop_server
done

python3 - "$out" <<'PY'
import json, pathlib, sys
print(f"{'front ends':>10}{'workers':>8}{'round':>6}{'out tok/s':>11}{'TPOT p50':>9}{'ITL p50':>9}{'ITL p99':>9}"
      f"{'client CPU':>11}")
for path in sorted(pathlib.Path(sys.argv[1]).glob("fe*-w*-r*.json")):
    fe, w, r = (part.lstrip("fewr") for part in path.stem.split("-"))
    d = json.loads(path.read_text())
    cpu = d.get("client_cpu_percent") or d.get("process_cpu_percent")
    print(f"{fe:>10}{w:>8}{r:>6}{d['output_throughput']:>11,.0f}{d['median_tpot_ms']:>9.2f}"
          f"{d['median_itl_ms']:>9.2f}{d['p99_itl_ms']:>9.1f}{cpu if cpu is None else f'{cpu:.0f}%':>11}")
PY
