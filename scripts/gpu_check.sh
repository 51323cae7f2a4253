#!/usr/bin/env bash
# `make gpu-check`: the one-GPU checks, lowest risk first, each step under its own time limit so a
# hang costs that step only and the rest still run; exits non-zero at the end if any step failed.
# The whole of `make gpu-check` (setup and csrc build included) finishes within 8 minutes:
# GPU_CHECK_DEADLINE (epoch seconds; the Makefile sets it when make starts) cuts every step's limit
# to the time left, and a step with no time left is skipped and reported as failed.
# Benchmark rows go to $GPU_CSV (default: $OUT/gpu-check.csv where the device tool sets OUT, else
# benchmarks/results/gpu-check.csv). Usage: PY=python3 bash scripts/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
GPU_CSV=${GPU_CSV:-${OUT:+$OUT/gpu-check.csv}}
GPU_CSV=${GPU_CSV:-benchmarks/results/gpu-check.csv}
# Scripts under benchmarks/ import the package from this checkout, installed or not.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=32  # a hardware queue per rank stream in the one-GPU world
# The steps where ranks share one GPU also load every module at start: kernels spinning on flags
# must never wait behind a lazily loaded module (loading can need a context-wide sync, and those
# ranks share a context). The ops warm their kernels up too; eager loading costs start-up time, so
# only these steps pay it.
EAGER=(env CUDA_MODULE_LOADING=EAGER)
export PYTHONUNBUFFERED=1

deadline=${GPU_CHECK_DEADLINE:-$(( $(date +%s) + 465 ))}
failed=()
step() {  # step SECONDS NAME CMD...
  local limit=$1 name=$2
  shift 2
  local left=$(( deadline - $(date +%s) - 12 ))  # 10 s for timeout's --kill-after, 2 to report
  if [ "$left" -lt 5 ]; then
    echo "=== $name: skipped, no time left before the 8-minute deadline"
    failed+=("$name (skipped: no time left)")
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "=== $name (limit ${limit} s)"
  local start=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}

timeout 60 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA GPU visible')" \
  || exit 2
# Limits add up to 470 s, more than the deadline leaves after setup and the csrc build: a step that
# runs long shortens the ones after it (riskiest last), never the whole run past 8 minutes.
step 30 info "$PY" -m overlapkernels info
# kernels alone, the csrc library, ring attention on two processes
step 120 "gpu tests (kernels, csrc, ring)" "$PY" -m pytest -m gpu -v --ignore=tests/test_ops_tp_gpu.py
step 50 bench_fused_gemm "$PY" benchmarks/bench_fused_gemm.py --csv "$GPU_CSV"
step 25 bench_reduce "$PY" benchmarks/bench_reduce.py --csv "$GPU_CSV"
step 75 bench_flash_attn "$PY" benchmarks/bench_flash_attn.py --csv "$GPU_CSV"
# several ranks spinning on flags on one GPU: the riskiest, so last
step 120 "gpu tests (symm/fused, one GPU)" "${EAGER[@]}" "$PY" -m pytest -m gpu -v --maxfail=2 tests/test_ops_tp_gpu.py
step 50 bench_one_gpu_ag_matmul "${EAGER[@]}" "$PY" benchmarks/bench_one_gpu_ag_matmul.py --csv "$GPU_CSV"

echo "=== results: $GPU_CSV"
if [ ${#failed[@]} -gt 0 ]; then
  printf '=== FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "=== gpu-check: all steps passed"
