#!/usr/bin/env bash
# `infertrace serve` under an open-loop load of long prompts, with prefill and mixed steps replayed from
# token-count CUDA graphs and then run eagerly (--no-prefill-cuda-graphs), one server after the other on the same
# requests. After each measured run, a shorter profiled run at the same rate captures PROFILE_STEPS steps through
# /start_profile for `infertrace analyze` (enough steps to pass the first arrivals and hold mixed steps; the
# measured run is not profiled, so the profiler's cost stays out of its percentiles). Results land in OUTDIR.
#
#   bash benchmarks/step_graphs_serve.sh [PRESET] [OUTDIR]
#   bash benchmarks/step_graphs_serve.sh qwen3-0.6b /tmp/step_graphs_serve
#   Each profiled capture is analysed at the end (analysis-MODE.json: `infertrace analyze --json`), and
#   OUTDIR/summary.json holds every mode's measured results, the capture's step phases and the graphs the server
#   captured at start-up (their token sizes, capture seconds and memory, from /server_info; and how long the
#   server took to answer /health).
#   (env: PORT 8000, RATE 60, NUM_PROMPTS 1200, INPUT_LEN 512, OUTPUT_LEN 128, MODES "graphs eager",
#    PROFILE_PROMPTS 300, PROFILE_STEPS 300, SERVE_ARGS: more `infertrace serve` flags for every mode, BENCH_ARGS:
#    more `infertrace bench` flags for every run, e.g. "--workers 4" to spread the load over four client processes)
set -euo pipefail
preset=${1:-qwen3-0.6b}
out=${2:-/tmp/step_graphs_serve}
port=${PORT:-8000}
rate=${RATE:-60}
num_prompts=${NUM_PROMPTS:-1200}
input_len=${INPUT_LEN:-512}
output_len=${OUTPUT_LEN:-128}
modes=${MODES:-graphs eager}
profile_prompts=${PROFILE_PROMPTS:-300}
profile_steps=${PROFILE_STEPS:-300}
mkdir -p "$out"

source "$(dirname "$0")/serve_lib.sh"
model=$(model_of "$preset" "$out")

for mode in $modes; do
  case $mode in
    graphs) flag=--prefill-cuda-graphs ;;
    eager) flag=--no-prefill-cuda-graphs ;;
    *) echo "unknown mode $mode"; exit 2 ;;
  esac
  stamp "starting the server ($mode)"
  t0=$(date +%s%N)
  "${it[@]}" serve --model "$model" --served-model-name "$preset" --port "$port" --profile-dir "$out/profile-$mode" \
    "$flag" ${SERVE_ARGS:-} >"$out/server-$mode.log" 2>&1 &
  server=$!
  wait_healthy "$port" "$out/server-$mode.log" 150
  ready_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  echo "$ready_ms" >"$out/ready_ms-$mode"
  stamp "server ready after $ready_ms ms"
  curl -s "http://127.0.0.1:$port/server_info" >"$out/server_info-$mode.json" || true
  load=(--base-url "http://127.0.0.1:$port" --tokenizer "$model" --request-rate "$rate" --input-len "$input_len"
        --output-len "$output_len" --ignore-eos --warmup 8 ${BENCH_ARGS:-})
  "${it[@]}" bench "${load[@]}" --seed 0 --num-prompts "$num_prompts" --result-json "$out/$mode.json"
  curl -s "http://127.0.0.1:$port/metrics" >"$out/metrics-$mode.txt" || true
  stamp "profiled run ($mode)"
  # prompts of another seed: with the same ones, a KV cache that still holds the measured run's prompts (an H200's
  # does) would serve them from the prefix cache, and the captured mixed steps would prefill 16 tokens, not 512
  "${it[@]}" bench "${load[@]}" --seed 1 --num-prompts "$profile_prompts" --profile --profile-steps "$profile_steps" \
    --result-json "$out/$mode-profiled.json"
  stop_server
  # the capture's step phases, here, so a remote run need not bring the traces back (analysis-MODE.json is small)
  "${it[@]}" analyze "$out/profile-$mode" --json "$out/analysis-$mode.json" >"$out/analysis-$mode.txt" 2>&1 ||
    echo "analyze of $out/profile-$mode failed: see $out/analysis-$mode.txt"
done

python3 - "$out" $modes <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"\n{'steps':<8}{'out tok/s':>10}  (ms:){'TTFT p50':>9}{'TTFT p99':>9}{'TPOT p50':>9}{'ITL p50':>9}{'ITL p99':>9}")
for mode in sys.argv[2:]:
    r = json.loads((out / f"{mode}.json").read_text())
    r = r.get("runs", [r])[0]
    print(f"{mode:<8}{r['output_throughput']:>10,.0f}{'':6}{r['median_ttft_ms']:>9.1f}{r['p99_ttft_ms']:>9.1f}"
          f"{r['median_tpot_ms']:>9.2f}{r['median_itl_ms']:>9.2f}{r['p99_itl_ms']:>9.1f}")
    try:  # the server's step_duration_seconds over the measured run, mean per step kind
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        continue
    sums = {}
    for family in text_string_to_metric_families((out / f"metrics-{mode}.txt").read_text()):
        if family.name.endswith("step_duration_seconds"):
            for s in family.samples:
                field = "sum" if s.name.endswith("_sum") else "count" if s.name.endswith("_count") else None
                if field:
                    sums.setdefault(s.labels.get("kind"), {})[field] = s.value
    print("    step mean (ms): " + ", ".join(f"{k} {1e3 * v['sum'] / v['count']:.2f} over {v['count']:.0f}"
                                           for k, v in sorted(sums.items()) if v.get("count")))
summary = {}
for mode in sys.argv[2:]:  # the profiled run's steps by phase (`infertrace analyze`), and one file with it all
    r = json.loads((out / f"{mode}.json").read_text())
    summary[mode] = {"measured": r.get("runs", [r])[0], "phases": None, "start_up": None}
    info = out / f"server_info-{mode}.json"
    if info.exists() and info.stat().st_size:  # what the engine captured at start-up, as the server reports it
        keys = ("cuda_graphs_captured", "prefill_cuda_graphs_captured", "cuda_graph_capture_s",
                "cuda_graph_memory_bytes", "kv_cache_dtype")
        server_info = json.loads(info.read_text())
        summary[mode]["start_up"] = {k: server_info.get(k) for k in keys}
        summary[mode]["start_up"]["cuda_graph_token_sizes"] = server_info.get("engine_config", {}).get(
            "cuda_graph_token_sizes")
        ready = out / f"ready_ms-{mode}"
        summary[mode]["start_up"]["server_ready_ms"] = int(ready.read_text()) if ready.exists() else None
    analysis = out / f"analysis-{mode}.json"
    if not analysis.exists():
        continue
    phases = json.loads(analysis.read_text())["tables"]["phases"]
    summary[mode]["phases"] = phases
    print(f"    {mode} capture: " + ", ".join(
        f"{p['type']} {p['steps']} steps, GPU busy {100 * p['gpu_busy_share']:.1f}%, host wait "
        f"{100 * p['host_wait_share']:.1f}%" for p in phases if p.get("gpu_busy_share") is not None))
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(f"    all of it: {out / 'summary.json'}")
PY
stamp "done"
