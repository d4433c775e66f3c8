#!/usr/bin/env bash
# Every tensor-parallel GPU test on a four-GPU machine in one go, two-GPU sets side by side on the two pairs:
#   phase 1: qwen3-0.6b TP=2 parity on GPUs 0,1 | qwen3-4b TP=2 parity on GPUs 2,3
#   phase 2: the ways out (tests/engine/test_tensor_parallel_exit.py) on GPUs 0,1 | the all-reduce + norm kernel on
#            GPUs 2,3 (two ranks)
#   phase 3: TP=4 parity of both models and the kernel on four ranks, on all four GPUs
# SETS=kernels (either machine): the one-GPU tests of the decode kernels written since the last GPU run (the early
# GEMM with SiLU-and-multiply in its epilogue; the pushing GEMM's stores), on GPU 0.
# On a two-GPU machine the two-GPU sets run one after another on GPUs 0,1 (SETS picks some) and phase 3 is left out. Each phase prints
# its lines as they come, and a failed run the end of its log; LIMIT_S caps each pytest run (default 240 s).
#   NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 bash benchmarks/tp_checks.sh
set -u
LIMIT_S=${LIMIT_S:-240}
LOGS=${LOGS:-$(mktemp -d)}
run() {  # run NAME GPUS pytest-args...: one pytest on those GPUs, its log kept, a summary line printed
    local name=$1 gpus=$2
    shift 2
    CUDA_VISIBLE_DEVICES=$gpus timeout "$LIMIT_S" python3 -m pytest -s -rA -p no:cacheprovider "$@" \
        >"$LOGS/$name.log" 2>&1
    local rc=$?
    echo "== $name (GPUs $gpus): exit $rc"
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|TP=|ranks:|passed|failed" "$LOGS/$name.log" | tail -20
    [ $rc -eq 0 ] || { echo "-- end of $name's log"; tail -60 "$LOGS/$name.log"; }
}
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels the GPU machine lacks (msgspec: `serve` imports it), carried along
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
GPUS=$(nvidia-smi -L | grep -c '^GPU')
T=tests/engine
date -u
if [ "${SETS:-}" = kernels ]; then
  run kernels 0 "$T/test_decode_kernels_gpu.py" -k "silu or pushing_gemm"
  exit 0
fi
if [ "$GPUS" -lt 4 ]; then
  echo "$GPUS GPUs: the two-GPU sets one after another, no TP=4"
  for set in ${SETS:-tp2-4b norm-2 exit tp2-0.6b}; do  # SETS: some of them, in this order
    case $set in
      tp2-4b) run tp2-4b 0,1 "$T/test_tensor_parallel_gpu.py" -k "4b-2" ;;
      norm-2) run norm-2 0,1 "$T/test_allreduce_norm_gpu.py" -k "2" ;;
      exit) run exit 0,1 "$T/test_tensor_parallel_exit.py" ;;
      tp2-0.6b) run tp2-0.6b 0,1 "$T/test_tensor_parallel_gpu.py" -k "0.6b-2" ;;
    esac
  done
  date -u
  echo "logs: $LOGS"
  exit 0
fi
run tp2-0.6b 0,1 "$T/test_tensor_parallel_gpu.py" -k "0.6b-2" &
run tp2-4b 2,3 "$T/test_tensor_parallel_gpu.py" -k "4b-2" &
wait
date -u
run exit 0,1 "$T/test_tensor_parallel_exit.py" &
run norm-2 2,3 "$T/test_allreduce_norm_gpu.py" -k "2" &
wait
date -u
run tp4 0,1,2,3 "$T/test_tensor_parallel_gpu.py" -k "b-4"
run norm-4 0,1,2,3 "$T/test_allreduce_norm_gpu.py" -k "4"
date -u
echo "logs: $LOGS"
