#!/usr/bin/env bash
# `infertrace serve` under `infertrace bench` on a GPU machine: one server, a concurrency sweep over HTTP, then a
# profiled run through /start_profile and /stop_profile. Prints bench's tables; results land in OUTDIR.
#
#   bash benchmarks/serve_bench.sh [PRESET] [OUTDIR] [CONCURRENCIES]
#   bash benchmarks/serve_bench.sh qwen3-0.6b /tmp/serve_bench 8,64,256   (PORT, NUM_PROMPTS: 8000, 512)
set -euo pipefail
preset=${1:-qwen3-0.6b}
out=${2:-/tmp/serve_bench}
concurrencies=${3:-8,64,256}
port=${PORT:-8000}
num_prompts=${NUM_PROMPTS:-512}
mkdir -p "$out"

if command -v infertrace >/dev/null; then it=(infertrace); else it=(python3 -c 'from infertrace.cli import main; main()'); fi
it() { "${it[@]}" "$@"; }

model="$out/$preset"
[ -f "$model/config.json" ] || it model init --preset "$preset" --out "$model"

stamp() { echo "[$(date +%T)] $*"; }

stop_server() {  # SIGTERM drains (up to 30 s); a server still there 60 s later gets SIGABRT, which dumps its threads
  kill -TERM $server 2>/dev/null || return 0
  for _ in $(seq 60); do kill -0 $server 2>/dev/null || { stamp "server exited"; return 0; }; sleep 1; done
  stamp "server still running 60 s after SIGTERM; SIGABRT (thread dump in $out/server.log)"
  kill -ABRT $server 2>/dev/null; sleep 2; tail -40 "$out/server.log"
}

stamp "starting the server"
PYTHONFAULTHANDLER=1 "${it[@]}" serve --model "$model" --served-model-name "$preset" --port "$port" \
  --profile-dir "$out/profile" >"$out/server.log" 2>&1 &
server=$!
trap stop_server EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { echo "server exited:"; tail -20 "$out/server.log"; exit 1; }
  sleep 1
done
curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "server not healthy after 300 s"; exit 1; }
stamp "server ready"
curl -s "http://127.0.0.1:$port/server_info"; echo

common=(--base-url "http://127.0.0.1:$port" --tokenizer "$model" --input-len 256 --output-len 128 --ignore-eos
        --seed 0 --warmup 8)
it bench "${common[@]}" --num-prompts "$num_prompts" --sweep "concurrency=$concurrencies" --result-json "$out/sweep.json"
stamp "profiled run"
it bench "${common[@]}" --num-prompts 64 --concurrency 8 --profile --profile-steps 10 \
  --result-json "$out/profiled.json"
ls -la "$out/profile"/*
stamp "done"
