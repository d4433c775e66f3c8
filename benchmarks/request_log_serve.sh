#!/usr/bin/env bash
# The request log's cost and what it explains, on `infertrace serve` under `infertrace bench`: servers with the log
# on (the default) and off (--request-log-size 0) in turn, ON OFF ON OFF, each under an open-loop load (RATE req/s,
# INPUT_LEN in / OUTPUT_LEN out, NUM_PROMPTS) and then a closed loop at SAT_CONCURRENCY streams; every run of an
# "on" server joins its requests with the server's log (--requests-jsonl). Prints one table: throughput, TTFT and
# ITL of every run, the on/off throughput ratio of each pair, and for the "on" runs the p50 and p99 cohorts' parts
# and the findings on the tail.
#
# Where the log's cost lands: during each run a sampler (request_log_cost.py --watch) reads the CPU seconds of the
# server's front end and engine process (/proc/PID/stat) and the requests the server has finished (/metrics) every
# 0.2 s; each run's CPU per request is taken between the first line after its warm-up and the last line before its
# last request ended, so neither the warm-up nor bench's read of the log after the run counts. Then, per load, the
# median on/off throughput ratio of the pairs with its range, and the median CPU per request of each process with
# the log on and off.
#
#   bash benchmarks/request_log_serve.sh [PRESET] [OUTDIR]
#   (env: PORT 8000, RATE 60, NUM_PROMPTS 1200, INPUT_LEN 512, OUTPUT_LEN 128, SAT_CONCURRENCY 256, SAT_PROMPTS 1024,
#    PAIRS 2: servers in the order "on off" that many times, or ORDER, e.g. "on off off on";
#    OPEN_LOOP 1, or 0: the closed loop at SAT_CONCURRENCY only;
#    SUMMARY_ONLY 1: no servers, only the table of the runs already in OUTDIR, e.g. after a run cut short)
#   e.g. the cost at saturation alone, four pairs: OPEN_LOOP=0 PAIRS=4 bash benchmarks/request_log_serve.sh
set -euo pipefail
preset=${1:-qwen3-0.6b}
out=${2:-/tmp/request_log_serve}
port=${PORT:-8000}
here=$(dirname "$0")
warmup=8
mkdir -p "$out"
source "$here/serve_lib.sh"
order=${ORDER:-$(for _ in $(seq "${PAIRS:-2}"); do printf 'on off '; done)}

watcher=""
stop_watcher() {
  [ -n "$watcher" ] || return 0
  kill -TERM "$watcher" 2>/dev/null || true
  wait "$watcher" 2>/dev/null || true
  watcher=""
}
trap 'stop_watcher; stop_server' EXIT

# measured KIND NAME BENCH_ARGS...: one bench run, with the server's CPU sampled into cpu-KIND-NAME.jsonl
measured() {
  local kind=$1 name=$2 cpu="$out/cpu-$1-$2.jsonl"; shift 2
  rm -f "$cpu"
  python3 "$here/request_log_cost.py" --watch "http://127.0.0.1:$port" --watch-out "$cpu" &
  watcher=$!
  until [ -s "$cpu" ]; do  # its first line comes before bench's first request
    kill -0 "$watcher" 2>/dev/null || { echo "the CPU sampler exited"; exit 1; }
    sleep 0.1
  done
  "${it[@]}" bench "${common[@]}" "$@" --result-json "$out/$kind-$name.json" >"$out/bench-$kind-$name.txt" 2>&1
  stop_watcher
}

i=0
[ "${SUMMARY_ONLY:-0}" = 1 ] && order="" || model=$(model_of "$preset" "$out")
for log in $order; do
  i=$((i + 1)); name="$i-$log"
  flags=(); [ "$log" = off ] && flags=(--request-log-size 0)
  stamp "server $name: starting"
  "${it[@]}" serve --model "$model" --served-model-name "$preset" --port "$port" "${flags[@]}" >"$out/server-$name.log" 2>&1 &
  server=$!
  wait_healthy "$port" "$out/server-$name.log" 150
  common=(--base-url "http://127.0.0.1:$port" --tokenizer "$model" --input-len "${INPUT_LEN:-512}"
          --output-len "${OUTPUT_LEN:-128}" --ignore-eos --warmup "$warmup")
  if [ "${OPEN_LOOP:-1}" != 0 ]; then
    stamp "server $name: ${RATE:-60} req/s"
    measured rate "$name" --request-rate "${RATE:-60}" --num-prompts "${NUM_PROMPTS:-1200}" --seed 0 \
      --requests-jsonl "$out/rate-$name.jsonl"
  fi
  stamp "server $name: ${SAT_CONCURRENCY:-256} streams"
  measured sat "$name" --concurrency "${SAT_CONCURRENCY:-256}" --num-prompts "${SAT_PROMPTS:-1024}" --seed 1
  stop_server
done
[ -z "$order" ] || stamp "done"

python3 - "$out" "$warmup" <<'PY'
import json, pathlib, statistics, sys
out, warmup = pathlib.Path(sys.argv[1]), int(sys.argv[2])


def cpu_per_request(path):
    """ms of CPU per finished request of the front end and of the engine, from the first sample after the warm-up
    to the last one before the run's last request ended; None when the run left too few samples, or when that
    window finished fewer than half the run's requests: in a run as short as one burst of its streams (256 prompts
    at 256 streams) the CPU of every request in flight would be divided among the few that ended in it."""
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    if len(lines) < 3:
        return None
    base, final = lines[0]["finished"], lines[-1]["finished"]
    first = next((k for k, s in enumerate(lines) if s["finished"] >= base + warmup), None)
    last = next((k for k, s in enumerate(lines) if s["finished"] >= final), len(lines)) - 1
    if first is None or last <= first or lines[last]["finished"] <= lines[first]["finished"]:
        return None
    n = lines[last]["finished"] - lines[first]["finished"]
    if n < (final - base) / 2:
        return None
    return {p: (lines[last][p] - lines[first][p]) / n * 1e3 for p in ("frontend", "engine")}


def spread(values):
    pairs = f"{len(values)} pair{'s' if len(values) > 1 else ''}"
    return f"{statistics.median(values):.4f} (range {min(values):.4f}-{max(values):.4f}, {pairs})"


rows, cpu = {}, {}
print(f"{'run':<12}{'tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p99':>9}  joined")
for f in sorted(out.glob("*-*-o*.json")):
    d = json.loads(f.read_text())
    kind, n, log = f.stem.split("-")
    rows[(kind, int(n), log)] = d
    cpu[(kind, int(n), log)] = c = cpu_per_request(out / f"cpu-{f.stem}.jsonl")
    joined = d.get("request_log") or {}
    print(f"{f.stem:<12}{d['output_throughput']:>10.0f}{d['median_ttft_ms']:>10.2f}{d['p99_ttft_ms']:>10.2f}"
          f"{d['p99_itl_ms']:>9.2f}  {joined.get('explained', '')}/{joined.get('requests', '')}"
          + (f", offset {joined['offset_ms']:.3f} +- {joined['offset_error_ms']:.3f} ms" if joined.get('offset_ms') is not None else "")
          + (f"  CPU/request: front end {c['frontend']:.3f} ms, engine {c['engine']:.3f} ms" if c else ""))
for kind in ("rate", "sat"):
    ns = sorted(n for k, n, _ in rows if k == kind)
    ratios = []
    for a, b in zip(ns[::2], ns[1::2]):
        pair = {log: d for (k, n, log), d in rows.items() if k == kind and n in (a, b)}
        on, off = pair.get("on"), pair.get("off")
        if on and off:
            ratios.append(on["output_throughput"] / off["output_throughput"])
            print(f"{kind} pair {a}/{b}: on/off output tok/s = {ratios[-1]:.4f}")
    if ratios:
        print(f"{kind}: on/off output tok/s, median {spread(ratios)}")
    for proc in ("frontend", "engine"):
        by_log = {log: [c[proc] for (k, _, lg), c in cpu.items() if k == kind and lg == log and c]
                  for log in ("on", "off")}
        if by_log["on"] and by_log["off"]:
            on, off = statistics.median(by_log["on"]), statistics.median(by_log["off"])
            print(f"{kind}: {proc} CPU ms per request, median on {on:.3f} (range {min(by_log['on']):.3f}-"
                  f"{max(by_log['on']):.3f}), off {off:.3f} (range {min(by_log['off']):.3f}-{max(by_log['off']):.3f}),"
                  f" on/off {on / off:.4f}")
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
