#!/usr/bin/env bash
# The request log's cost and what it explains, on `infertrace serve` under `infertrace bench`: servers with the log
# on (the default) and off (--request-log-size 0) in turn, ON OFF ON OFF, each under an open-loop load (RATE req/s,
# INPUT_LEN in / OUTPUT_LEN out, NUM_PROMPTS) and then a closed loop at SAT_CONCURRENCY streams; every run of an
# "on" server joins its requests with the server's log (--requests-jsonl). Prints one table: throughput, TTFT and
# ITL of every run, the on/off throughput ratio of each pair, and for the "on" runs the p50 and p99 cohorts' parts
# and the findings on the tail.
#
#   bash benchmarks/request_log_serve.sh [PRESET] [OUTDIR]
#   (env: PORT 8000, RATE 60, NUM_PROMPTS 1200, INPUT_LEN 512, OUTPUT_LEN 128, SAT_CONCURRENCY 256, SAT_PROMPTS 1024,
#    ORDER "on off on off")
set -euo pipefail
preset=${1:-qwen3-0.6b}
out=${2:-/tmp/request_log_serve}
port=${PORT:-8000}
mkdir -p "$out"
source "$(dirname "$0")/serve_lib.sh"
model=$(model_of "$preset" "$out")

i=0
for log in ${ORDER:-on off on off}; do
  i=$((i + 1)); name="$i-$log"
  flags=(); [ "$log" = off ] && flags=(--request-log-size 0)
  "${it[@]}" serve --model "$model" --served-model-name "$preset" --port "$port" "${flags[@]}" >"$out/server-$name.log" 2>&1 &
  server=$!
  wait_healthy "$port" "$out/server-$name.log" 150
  common=(--base-url "http://127.0.0.1:$port" --tokenizer "$model" --input-len "${INPUT_LEN:-512}"
          --output-len "${OUTPUT_LEN:-128}" --ignore-eos --warmup 8)
  "${it[@]}" bench "${common[@]}" --request-rate "${RATE:-60}" --num-prompts "${NUM_PROMPTS:-1200}" --seed 0 \
    --result-json "$out/rate-$name.json" --requests-jsonl "$out/rate-$name.jsonl" >"$out/bench-rate-$name.txt" 2>&1
  "${it[@]}" bench "${common[@]}" --concurrency "${SAT_CONCURRENCY:-256}" --num-prompts "${SAT_PROMPTS:-1024}" --seed 1 \
    --result-json "$out/sat-$name.json" >"$out/bench-sat-$name.txt" 2>&1
  stop_server
done

python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
print(f"{'run':<12}{'tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p99':>9}  joined")
for f in sorted(out.glob("*-*-o*.json")):
    d = json.loads(f.read_text())
    kind, n, log = f.stem.split("-")
    rows[(kind, int(n), log)] = d
    joined = d.get("request_log") or {}
    print(f"{f.stem:<12}{d['output_throughput']:>10.0f}{d['median_ttft_ms']:>10.2f}{d['p99_ttft_ms']:>10.2f}"
          f"{d['p99_itl_ms']:>9.2f}  {joined.get('explained', '')}/{joined.get('requests', '')}"
          + (f", offset {joined['offset_ms']:.3f} +- {joined['offset_error_ms']:.3f} ms" if joined.get('offset_ms') is not None else ""))
for kind in ("rate", "sat"):
    ns = sorted(n for k, n, _ in rows if k == kind)
    for a, b in zip(ns[::2], ns[1::2]):
        on, off = rows.get((kind, a, "on")), rows.get((kind, b, "off"))
        if on and off:
            print(f"{kind} pair {a}/{b}: on/off output tok/s = {on['output_throughput'] / off['output_throughput']:.4f}")
for (kind, n, log), d in sorted(rows.items()):
    joined = d.get("request_log") or {}
    if kind != "rate" or log != "on" or not joined.get("cohorts"):
        continue
    for name, c in joined["cohorts"].items():
        parts = ", ".join(f"{p} {v:.2f}" for p, v in c["parts_ms"].items())
        print(f"{kind}-{n} {name}: {c['requests']} requests, TTFT {c['ttft_ms']:.2f} ms = {parts}; "
              f"behind {c['queued_behind_prefills']:.0f} prefills")
    for fnd in d.get("findings", []):
        if fnd.get("rule") in ("ttft_tail", "itl_tail"):
            print(f"  finding: {fnd.get('what')} | {fnd.get('evidence')}")
PY
