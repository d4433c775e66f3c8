#!/usr/bin/env bash
# `infertrace serve --tensor-parallel-size N` under `infertrace bench`, TP=1 beside TP=2 on one two-GPU machine, and
# a two-rank capture of the TP=2 server under load explained by `infertrace analyze` and by HTA, in one call:
#   1. `infertrace model init` of PRESET (bf16), once (MODEL_DIR, outside OUTDIR: 8 GB for qwen3-4b);
#   2. for TP in 1 2 (CUDA_VISIBLE_DEVICES 0, then 0,1): start the server, wait for /health, then
#      a. an open loop at RATE req/s (Poisson), INPUT_LEN in / OUTPUT_LEN out random tokens, RATE_PROMPTS requests,
#      b. STREAMS concurrent streams (request rate inf, at most STREAMS in flight), STREAM_PROMPTS requests,
#      c. TP=2 only: a shorter open loop at RATE, during which `infertrace profile --start --num-steps PROFILE_STEPS`
#         captures every rank's torch.profiler trace (capture-tp2), collected with `infertrace profile --stop`,
#      then SIGTERM: the time to the server's exit and to the end of every process of it is recorded; a server (or
#      a process of it) still there 20 s after SIGTERM is killed with SIGKILL and reported as a failure;
#   3. `infertrace analyze` of the capture (per-rank communication share, exposed communication, step skew, the
#      cross-rank critical path) and HTA's get_comm_comp_overlap on the same rank files (benchmarks/tp_serve.py);
#   4. one table (OUTDIR/table.txt) and OUTDIR/summary.json.
# A step that fails is a line under FAILURES and the run goes on; the exit status is 1 when there was any.
#
#   bash benchmarks/tp_serve.sh [PRESET=qwen3-4b] [OUTDIR=/tmp/tp_serve]
#   (env: PORT 8000, RATE 60, RATE_PROMPTS 1200 (20 s), STREAMS 256, STREAM_PROMPTS 768, INPUT_LEN 512, OUTPUT_LEN 128,
#    PROFILE_PROMPTS 600, PROFILE_STEPS 150, PROFILE_DELAY_S 5, TPS "1 2", MODEL_DIR /tmp/tp_serve-PRESET,
#    START_TIMEOUT_S 300, BENCH_TIMEOUT_S 240, BUDGET_S 480 (no new server or load starts past it, so that the
#    analysis still ends inside a 10-minute limit),
#    SERVE_ARGS / BENCH_ARGS: more flags for every server / bench run, COMMIT: the code's id where there is no .git,
#    COPY_TO: a folder that also gets summary.json, table.txt, analysis-tp2.{txt,json,html}, hta-tp2.json and
#    failures.txt, named tp_serve-*: seven files)
set -uo pipefail
set +m  # no job control: a server started in the background stays this script's child, in the session setsid gives it
preset=${1:-qwen3-4b}
out=${2:-/tmp/tp_serve}
port=${PORT:-8000}
rate=${RATE:-60}
rate_prompts=${RATE_PROMPTS:-1200}
streams=${STREAMS:-256}
stream_prompts=${STREAM_PROMPTS:-768}
input_len=${INPUT_LEN:-512}
output_len=${OUTPUT_LEN:-128}
profile_prompts=${PROFILE_PROMPTS:-600}
profile_steps=${PROFILE_STEPS:-150}
profile_delay=${PROFILE_DELAY_S:-5}
tps=${TPS:-1 2}
model=${MODEL_DIR:-/tmp/tp_serve-$preset}
start_timeout=${START_TIMEOUT_S:-300}
bench_timeout=${BENCH_TIMEOUT_S:-240}
budget=${BUDGET_S:-480}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off on shared machines (NCCL NVLS, symmetric-memory multimem, NVSHMEM NVLS)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$out"
: >"$out/failures.txt"
t_start=$(date +%s)

if command -v infertrace >/dev/null; then it=(infertrace); else it=(python3 -c 'from infertrace.cli import main; main()'); fi
stamp() { echo "[$(date +%T)] $*"; }
fail() { stamp "FAILURE: $*"; echo "$*" >>"$out/failures.txt"; }
left() { echo $((budget - ($(date +%s) - t_start))); }
now() { date +%s.%N; }
alive() { local state; state=$(ps -o stat= -p "$1" 2>/dev/null) && [[ $state != Z* ]]; }  # a zombie has exited
others() { ps -o pid=,stat= -s "$1" 2>/dev/null | awk -v p="$1" '$1 != p && $2 !~ /^Z/ {print $1}'; }  # its session
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.3f}')" "$1" "$(now)"; }

device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | sed 's/^ *//; s/ /x /' | paste -sd, -)
nvidia-smi topo -m >"$out/topology.txt" 2>&1 || true
commit=${COMMIT:-$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)}
python3 - "$out/meta.json" "$preset" "${device:-no GPU}" "$commit" "$input_len" "$output_len" "$rate" "$streams" \
  "$rate_prompts" "$stream_prompts" "$profile_prompts" "$profile_steps" "${SERVE_ARGS:-}" "${BENCH_ARGS:-}" <<'PY'
import datetime, json, sys
path, preset, device, commit, inp, outp, rate, streams, *rest = sys.argv[1:]
json.dump({"preset": preset, "device": device, "commit": commit, "input_len": int(inp), "output_len": int(outp),
           "rate": float(rate), "streams": int(streams), "rate_prompts": int(rest[0]), "stream_prompts": int(rest[1]),
           "profile_prompts": int(rest[2]), "profile_steps": int(rest[3]), "serve_args": rest[4], "bench_args": rest[5],
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}, open(path, "w"))
PY
python3 -c "import hta.trace_analysis" 2>"$out/hta-import.txt" ||
  fail "HTA (traceinsight) does not import here: $(tail -1 "$out/hta-import.txt"); its column will be empty"

# 1. the model, once
stamp "model $preset in $model"
if [ ! -f "$model/config.json" ]; then
  t0=$(now)
  # the weights drawn on the GPU where there is one (qwen3-4b took 164 s on a GPU host's CPU)
  python3 -c 'import sys, torch; from infertrace.modelgen import init_model
init_model(sys.argv[1], sys.argv[2], seed=0, dtype="bfloat16", device="cuda" if torch.cuda.is_available() else "cpu")' \
    "$preset" "$model" >"$out/model-init.log" 2>&1 ||
    { fail "model init failed: $(tail -1 "$out/model-init.log")"; exit 1; }
  stamp "model written in $(since "$t0") s"
fi

server=""
server_tp=""
t_term=""
stop_server() {  # SIGTERM; the exit of the server and of every process of its session timed; SIGKILL only past 20 s
  [ -n "$server" ] || return 0
  local pid=$server tp=$server_tp code=0 exit_s="" gone_s="" killed="" left_pids="" early=""
  server=""
  if ! alive "$pid"; then  # it ended before it was asked to
    wait "$pid" 2>/dev/null; code=$? early=1 exit_s=-1
    fail "TP$tp server: exited by itself during the run, status $code: $(grep -v '^\s*$' "$out/server-tp$tp.log" | tail -1 | cut -c1-200)"
  fi
  t_term=$(now)
  local deadline=$(( $(date +%s%N) + 20000000000 ))
  [ -n "$early" ] || kill -TERM "$pid" 2>/dev/null
  while [ "$(date +%s%N)" -lt "$deadline" ]; do
    [ -z "$exit_s" ] && ! alive "$pid" && exit_s=$(since "$t_term")
    if [ -n "$exit_s" ] && [ -z "$(others "$pid")" ]; then gone_s=$(since "$t_term"); break; fi
    sleep 0.05
  done
  if [ -z "$exit_s" ] || [ -z "$gone_s" ]; then
    left_pids=$( { [ -z "$exit_s" ] && echo "$pid"; others "$pid"; } | sort -u | paste -sd' ' -)
    local what="TP$tp server: still running 20 s after SIGTERM"
    [ -n "$exit_s" ] && what="TP$tp server: exited $exit_s s after SIGTERM, but processes of it still ran 20 s after"
    fail "$what: $(ps -o pid=,args= -p "${left_pids// /,}" 2>/dev/null | sed 's/^ *//' | cut -c1-120 | paste -sd';' -); SIGKILL"
    for p in $left_pids; do kill -KILL "$p" 2>/dev/null; done
    killed=1
  fi
  [ -n "$early" ] || { wait "$pid" 2>/dev/null; code=$?; }
  [ -n "$early" ] && exit_s=""
  [ -n "$early" ] || stamp "TP$tp server: exit ${exit_s:-(killed)} s after SIGTERM, status $code, every process gone after ${gone_s:-(killed)} s"
  [ -n "$killed" ] || [ -n "$early" ] || [ "$code" = 0 ] || fail "TP$tp server: exit status $code after SIGTERM (see $out/server-tp$tp.log)"
  python3 - "$out/server-tp$tp.json" "$exit_s" "$gone_s" "$code" "$killed" "$left_pids" "$early" <<'PY'
import json, sys
path, exit_s, gone_s, code, killed, left, early = sys.argv[1:]
doc = json.load(open(path)) if __import__("os").path.exists(path) else {}
doc |= {"exit_s": float(exit_s) if exit_s else None, "all_gone_s": float(gone_s) if gone_s else None,
        "exit_code": int(code), "sigkill": bool(killed), "left_behind": left or None,
        "exited_by_itself": bool(early)}
json.dump(doc, open(path, "w"), indent=1)
PY
}
trap stop_server EXIT
trap 'exit 143' TERM  # a stopped run still stops its server (bash runs the EXIT trap only through a trap of its own)
trap 'exit 130' INT
if command -v setsid >/dev/null; then session=(setsid); else
  session=(python3 -c 'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])'); fi

start_server() {  # start_server TP: 0 when healthy
  local tp=$1 devices t0
  devices=$(seq -s, 0 $((tp - 1)))
  stamp "TP$tp: starting the server on CUDA_VISIBLE_DEVICES=$devices"
  rm -rf "$out/profile-tp$tp"
  t0=$(now)
  # a session of its own, so that every process of the server (engine, ranks) can be found after it exits
  CUDA_VISIBLE_DEVICES=$devices PYTHONFAULTHANDLER=1 "${session[@]}" "${it[@]}" serve --model "$model" \
    --served-model-name "$preset" --port "$port" --tensor-parallel-size "$tp" --profile-dir "$out/profile-tp$tp" \
    ${SERVE_ARGS:-} >"$out/server-tp$tp.log" 2>&1 &
  server=$! server_tp=$tp
  local limit=$(( $(left) < start_timeout ? $(left) : start_timeout ))
  for _ in $(seq $((limit * 2))); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    if ! alive "$server"; then
      wait "$server"; local code=$?; server=""
      fail "TP$tp server exited while starting (status $code): $(grep -v '^\s*$' "$out/server-tp$tp.log" | tail -1 | cut -c1-200)"
      return 1
    fi
    sleep 0.5
  done
  if ! curl -sf "http://127.0.0.1:$port/health" >/dev/null; then
    fail "TP$tp server not healthy after ${limit} s"
    stop_server
    return 1
  fi
  local ready_s; ready_s=$(since "$t0")
  curl -s "http://127.0.0.1:$port/server_info" >"$out/server_info-tp$tp.json" || true
  python3 - "$out/server-tp$tp.json" "$tp" "$ready_s" "$out/server_info-tp$tp.json" <<'PY'
import json, sys
path, tp, ready, info_path = sys.argv[1:]
try:
    info = json.load(open(info_path))
except (OSError, ValueError):
    info = {}
keys = ("all_reduce", "all_reduce_note", "attention_backend", "async_scheduling", "skinny_gemm",
        "cuda_graphs_captured", "prefill_cuda_graphs_captured", "cuda_graph_capture_s", "device")
json.dump({"tp": int(tp), "ready_s": float(ready)} | {k: info.get(k) for k in keys}, open(path, "w"), indent=1)
PY
  stamp "TP$tp server ready after $ready_s s"
}

load=(--base-url "http://127.0.0.1:$port" --tokenizer "$model" --input-len "$input_len" --output-len "$output_len"
      --ignore-eos --warmup 8 --request-timeout 120 ${BENCH_ARGS:-})
copy_back() {  # the few files worth bringing back from a remote machine, to COPY_TO when set
  [ -n "${COPY_TO:-}" ] || return 0
  mkdir -p "$COPY_TO"
  for f in summary.json table.txt analysis-tp2.txt analysis-tp2.json analysis-tp2.html hta-tp2.json failures.txt; do
    [ -f "$out/$f" ] && cp "$out/$f" "$COPY_TO/tp_serve-$f"
  done
  return 0
}

bench() {  # bench NAME [flags...]: one run, its result in OUTDIR/NAME.json, its output in NAME.txt
  local name=$1; shift
  if [ "$(left)" -lt 30 ]; then fail "$name: not run, the time budget (BUDGET_S=$budget) is spent"; return 1; fi
  stamp "$name: bench $*"
  timeout "$bench_timeout" "${it[@]}" bench "${load[@]}" "$@" --result-json "$out/$name.json" >"$out/$name.txt" 2>&1
  local code=$?
  stamp "$(python3 "$here/tp_serve.py" figures "$out/$name.json")"
  [ "$code" = 0 ] || fail "$name: bench exited with status $code: $(grep -v '^\s*$' "$out/$name.txt" | tail -1 | cut -c1-200)"
  return $code
}

profile_tp2() {  # a two-rank capture under the open-loop load; its files under OUTDIR/profile-tp2/capture-tp2
  local url="http://127.0.0.1:$port"
  if [ "$(left)" -lt 45 ]; then fail "TP2 capture: not taken, the time budget is spent"; return 1; fi
  bench tp2-profiled --request-rate "$rate" --num-prompts "$profile_prompts" --seed 2 &
  local bench_pid=$!
  sleep "$profile_delay"
  stamp "TP2 capture: infertrace profile --start --num-steps $profile_steps"
  timeout 120 "${it[@]}" profile --url "$url" --start --num-steps "$profile_steps" --name tp2 \
    >"$out/profile-start.txt" 2>&1 || fail "TP2 capture: profile --start: $(tail -1 "$out/profile-start.txt")"
  wait "$bench_pid"
  timeout 300 "${it[@]}" profile --url "$url" --stop >"$out/profile-stop.txt" 2>&1 ||
    fail "TP2 capture: profile --stop: $(tail -1 "$out/profile-stop.txt")"
  stamp "TP2 capture: $(ls "$out"/profile-tp2/capture-tp2/*.pt.trace.json* 2>/dev/null | wc -l) rank trace(s), $(du -sh "$out/profile-tp2" 2>/dev/null | cut -f1)"
}

# 2. each TP: the two loads (and, at TP=2, the capture), then a clean stop
for tp in $tps; do
  if [ "$(left)" -lt 90 ]; then fail "TP$tp: not run, the time budget (BUDGET_S=$budget) is spent"; continue; fi
  start_server "$tp" || continue
  bench "tp$tp-rate" --request-rate "$rate" --num-prompts "$rate_prompts" --seed 0
  bench "tp$tp-streams" --request-rate inf --concurrency "$streams" --num-prompts "$stream_prompts" --seed 1
  [ "$tp" = 2 ] && profile_tp2
  stop_server
done

# 3. the capture, by infertrace analyze and by HTA on the same files
capture="$out/profile-tp2/capture-tp2"
if ls "$capture"/*.pt.trace.json* >/dev/null 2>&1; then
  stamp "infertrace analyze $capture"
  t0=$(now)
  COLUMNS=${COLUMNS:-200} "${it[@]}" analyze "$capture" --json "$out/analysis-tp2.json" >"$out/analysis-tp2.txt" 2>&1 ||
    fail "analyze of $capture failed: $(tail -1 "$out/analysis-tp2.txt")"
  stamp "analyze took $(since "$t0") s; its HTML report (from analyze's cache)"
  # apart, since the page needs plotly, which the JSON does not
  "${it[@]}" analyze "$capture" --html "$out/analysis-tp2.html" --quiet >"$out/analysis-tp2-html.txt" 2>&1 ||
    fail "analyze --html of $capture failed: $(tail -1 "$out/analysis-tp2-html.txt")"
  python3 "$here/tp_serve.py" summary "$out" "$preset" >/dev/null; copy_back  # kept if HTA runs out of time
  stamp "HTA on the same rank files"
  t0=$(now)
  python3 "$here/tp_serve.py" hta "$capture" "$out/analysis-tp2.json" "$out/hta-tp2.json" 2>"$out/hta-tp2.txt" ||
    fail "HTA on $capture: $(tail -1 "$out/hta-tp2.txt")"
  stamp "HTA took $(since "$t0") s"
else
  [[ " $tps " == *" 2 "* ]] && fail "no TP2 capture to analyse"
fi

# 4. one table, and summary.json
python3 "$here/tp_serve.py" summary "$out" "$preset"
stamp "done in $(( $(date +%s) - t_start )) s; everything in $out"
copy_back
[ ! -s "$out/failures.txt" ]
