#!/usr/bin/env bash
# `infertrace serve` against the bundled engine alone, on the same requests, in one call on a GPU machine:
#   1. offline: the engine alone (`LLM.generate`, benchmarks/offline_same_requests.py) on the requests bench sends;
#   2. the server as it runs by default (the engine in a process of its own), a concurrency sweep over HTTP;
#   3. the same with --engine-in-process (the engine on a thread of the HTTP process: the server before the split);
#   4. with API_SERVERS > 1, the server with that many front ends at the highest concurrency;
#   5. a profiled run through /start_profile and /stop_profile on the default server.
# Then one table: output tok/s, TPOT and ITL, and each row's ratio to the offline figure. Results land in OUTDIR.
#
#   bash benchmarks/serve_bench.sh [PRESET] [OUTDIR] [CONCURRENCIES]
#   bash benchmarks/serve_bench.sh qwen3-0.6b /tmp/serve_bench 8,64,256
#   (env: PORT 8000, NUM_PROMPTS 512, INPUT_LEN 256, OUTPUT_LEN 128, API_SERVERS 2, MODES "split inproc")
set -euo pipefail
preset=${1:-qwen3-0.6b}
out=${2:-/tmp/serve_bench}
concurrencies=${3:-8,64,256}
port=${PORT:-8000}
num_prompts=${NUM_PROMPTS:-512}
input_len=${INPUT_LEN:-256}
output_len=${OUTPUT_LEN:-128}
api_servers=${API_SERVERS:-2}
modes=${MODES:-split inproc}
mkdir -p "$out"

source "$(dirname "$0")/serve_lib.sh"
model=$(model_of "$preset" "$out")

stop_server() {  # serve_lib's, but SIGABRT past 60 s, which dumps the server's threads
  [ -n "$server" ] || return 0
  kill -TERM "$server" 2>/dev/null || { server=""; return 0; }
  for _ in $(seq 60); do kill -0 "$server" 2>/dev/null || { stamp "server exited"; server=""; return 0; }; sleep 1; done
  stamp "server still running 60 s after SIGTERM; SIGABRT (thread dump in its log)"
  kill -ABRT "$server" 2>/dev/null; sleep 2; server=""
}
trap stop_server EXIT

start_server() {  # start_server NAME [serve flags...]
  local name=$1; shift
  stamp "starting the server: $name $*"
  PYTHONFAULTHANDLER=1 "${it[@]}" serve --model "$model" --served-model-name "$preset" --port "$port" \
    --profile-dir "$out/profile" "$@" >"$out/server-$name.log" 2>&1 &
  server=$!
  wait_healthy "$port" "$out/server-$name.log"
  stamp "server ready"
}

load=(--input-len "$input_len" --output-len "$output_len" --ignore-eos --seed 0 --warmup 8 --num-prompts "$num_prompts")
http=(--base-url "http://127.0.0.1:$port" --tokenizer "$model" "${load[@]}")

stamp "offline: the engine alone on the same requests, every request at once"
python3 "$(dirname "$0")/offline_same_requests.py" "$model" --input-len "$input_len" --output-len "$output_len" \
  --num-prompts "$num_prompts" --seed 0 --result-json "$out/offline.json"

for mode in $modes; do
  case $mode in
    split) start_server split ;;
    inproc) start_server inproc --engine-in-process ;;
    *) echo "unknown mode $mode"; exit 2 ;;
  esac
  it bench "${http[@]}" --sweep "concurrency=$concurrencies" --result-json "$out/sweep-$mode.json"
  if [ "$mode" = split ]; then
    stamp "profiled run"
    it bench "${http[@]}" --num-prompts 64 --concurrency 8 --profile --profile-steps 10 \
      --result-json "$out/profiled.json"
  fi
  stop_server
done

if [ "$api_servers" -gt 1 ]; then
  top=${concurrencies##*,}
  start_server "api$api_servers" --api-server-count "$api_servers"
  it bench "${http[@]}" --concurrency "$top" --result-json "$out/sweep-api$api_servers.json"
  stop_server
fi

python3 - "$out" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def runs(path):
    doc = json.loads(path.read_text())
    return doc.get("runs", [doc])
offline = runs(out / "offline.json")[0]["output_throughput"]
print(f"\n{'server':<22}{'streams':>8}{'out tok/s':>11}{'/offline':>9}  (ms:){'TPOT p50':>9}{'ITL p50':>9}"
      f"{'ITL p99':>9}{'TTFT p50':>10}")
print(f"{'offline (no HTTP)':<22}{'all':>8}{offline:>11,.0f}{1:>9.2f}")
for path in sorted(out.glob("sweep-*.json")):
    for r in runs(path):
        print(f"{path.stem[6:]:<22}{r['max_concurrency']:>8}{r['output_throughput']:>11,.0f}"
              f"{r['output_throughput'] / offline:>9.2f}{'':6}{r['median_tpot_ms']:>9.2f}{r['median_itl_ms']:>9.2f}"
              f"{r['p99_itl_ms']:>9.1f}{r['median_ttft_ms']:>10.1f}")
EOF
ls -la "$out/profile"/* | tail -5
stamp "done"
