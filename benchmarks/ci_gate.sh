#!/usr/bin/env bash
# The project's own performance gate: a small CPU benchmark of the bundled engine on the built-in tiny model, run on
# this machine for this checkout and for a reference commit, interleaved, and checked by `infertrace gate`.
#
#   bash benchmarks/ci_gate.sh                    # exit 0 pass, 1 regression, 2 unusable input
#   bash benchmarks/ci_gate.sh --update-baseline  # re-record benchmarks/gate_baseline.json from this checkout
#   GATE_REPEATS=2 bash benchmarks/ci_gate.sh     # runs of each code (3 unless set)
#
# The gated figure is CPU time per output token. On one machine it holds still where wall-clock throughput does
# not (five runs of unchanged code on a shared 2-core machine: 77 to 139 tok/s, 7.1 to 7.6 ms per token), but it
# does not carry from one machine to another: the same commit measured 5.1 ms on one 2-core CI machine and 8.0-8.2
# ms on another, more than the bound. So the baseline is measured here, in the same run: REFERENCE's code (taken
# from git into a temporary folder, with the same installed packages) and this checkout take turns, and the gate
# compares the two sets of runs. A clone without REFERENCE (a shallow one) falls back to the recorded
# benchmarks/gate_baseline.json and says so. Move REFERENCE forward with a change that is meant to move the figure.
#
# The bound is +40% (an engine made to do twice the work per step gives about +100%); wall-clock throughput is
# gated only against collapse. A bound fails only when the whole bootstrap interval lies beyond it, so scattered runs
# widen the interval rather than raise false alarms: on one CI machine whose runs scattered by about 20%, a doubled
# step came out at +94% with the interval [+37%, +160%] and passed as within noise.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

# one intra-op thread: CPU time then counts work, not threads spinning while they wait for a busy core
export OMP_NUM_THREADS=1
REFERENCE=09a99284c772ac09199501444ec8418028beba9d
BASELINE=benchmarks/gate_baseline.json
REPEATS=${GATE_REPEATS:-3}
WORKLOAD=(--num-prompts 16 --concurrency 4 --input-len 64 --output-len 32 --ignore-eos --seed 0)
BOUNDS=(--max-rise cpu_ms_per_output_token=40% --max-drop output_throughput=75% --max failed=0)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/current" "$work/reference"

# one benchmark run of the code in folder $1 (imported from there, whatever is installed), result to $2; each code
# builds its own built-in model, in a cache of its own, so a change to that model is measured too
bench_run() {
    local code=$1 out=$2
    if ! (cd "$code" && export INFERTRACE_CACHE="$work/cache-$(basename "$(dirname "$out")")" \
            PYTHONPATH="$code${PYTHONPATH:+:$PYTHONPATH}" && python -m infertrace bench "${WORKLOAD[@]}" \
            --result-json "$out" >"$out.log" 2>&1); then
        cat "$out.log" >&2
        echo "ci_gate: the benchmark of $code failed" >&2
        exit 2
    fi
}

if [ "${1:-}" = "--update-baseline" ]; then
    for i in $(seq "$REPEATS"); do
        echo "ci_gate: benchmark run $i of $REPEATS" >&2
        bench_run "$root" "$work/current/run-$i.json"
    done
    python -m infertrace gate "$work"/current/run-*.json --baseline "$BASELINE" --update-baseline "${BOUNDS[@]}"
    exit 0
fi

reference=""
if git cat-file -e "$REFERENCE^{commit}" 2>/dev/null; then
    reference="$work/code"
    mkdir -p "$reference"
    git archive "$REFERENCE" infertrace | tar -x -C "$reference"
    imported=$(cd "$reference" && PYTHONPATH="$reference" python -c 'import infertrace; print(infertrace.__file__)')
    case "$imported" in
        "$reference"/*) ;;
        *) echo "ci_gate: the reference code imports from $imported, not $reference" >&2; exit 2 ;;
    esac
    echo "ci_gate: against ${REFERENCE:0:12}, measured here in turn with this checkout" >&2
else
    echo "ci_gate: ${REFERENCE:0:12} is not in this clone; against $BASELINE, recorded on another machine" >&2
fi

for i in $(seq "$REPEATS"); do
    echo "ci_gate: benchmark run $i of $REPEATS" >&2
    [ -z "$reference" ] || bench_run "$reference" "$work/reference/run-$i.json"
    bench_run "$root" "$work/current/run-$i.json"
done

base=$BASELINE
if [ -n "$reference" ]; then
    base="$work/reference.json"
    python -m infertrace gate "$work"/reference/run-*.json --baseline "$base" --update-baseline "${BOUNDS[@]}" >/dev/null
fi
python -m infertrace gate "$work"/current/run-*.json --baseline "$base" "${BOUNDS[@]}" \
    ${GITHUB_STEP_SUMMARY:+--summary "$GITHUB_STEP_SUMMARY"}
