#!/usr/bin/env bash
# `make gpu-check`: the one-GPU checks, low risk first (but the one-GPU worlds before most benchmarks:
# see there), each step under its own time limit so a hang costs that step only and the rest still
# run; exits non-zero at the end if any step failed.
# The whole of `make gpu-check` (setup included) finishes within 8 minutes: GPU_CHECK_DEADLINE
# (epoch seconds; the Makefile sets it when make starts) bounds the CUDA probe and cuts every step's
# limit (the csrc build's too) to the time left; a step with no time left is skipped, reported failed.
# Benchmark rows go to $GPU_CSV (default: $OUT/gpu-check.csv where the device tool sets OUT, else
# benchmarks/results/gpu-check.csv), each row as it is measured. Every step's full output also goes
# to $GPU_LOGS/gpu-check.log, under a "##### step <name>" line, and a pytest step's results to
# $GPU_LOGS/<step>.xml (GPU_LOGS: $OUT, else benchmarks/results/gpu-check-logs): the device tool
# returns only the tail of stdout, which ends with a summary table of every step, and at most 8
# files from $OUT, so the script leaves 4 there (the CSV, the log, two XMLs), not one per step.
# Usage: PY=python3 bash scripts/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
GPU_CSV=${GPU_CSV:-${OUT:+$OUT/gpu-check.csv}}
GPU_CSV=${GPU_CSV:-benchmarks/results/gpu-check.csv}
GPU_LOGS=${GPU_LOGS:-${OUT:-benchmarks/results/gpu-check-logs}}
mkdir -p "$GPU_LOGS"
GPU_LOG=$GPU_LOGS/gpu-check.log
: > "$GPU_LOG"
# Scripts under benchmarks/ import the package from this checkout, installed or not.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=32  # a hardware queue per rank stream in the one-GPU world
# The steps where ranks share one GPU also load every module at start: kernels spinning on flags
# must never wait behind a lazily loaded module (loading can need a context-wide sync, and those
# ranks share a context). The ops warm their kernels up too; eager loading costs start-up time, so
# only these steps pay it.
EAGER=(env CUDA_MODULE_LOADING=EAGER)
export PYTHONUNBUFFERED=1
# Concise on stdout (the logs and XML hold the rest): a dot per test, failures and errors listed.
PYTEST=("$PY" -m pytest -q -rfE)

deadline=${GPU_CHECK_DEADLINE:-$(( $(date +%s) + 465 ))}
time_left() { echo $(( deadline - $(date +%s) - 12 )); }  # 10 s for timeout's --kill-after, 2 to report
failed=()
summary=()  # "step|status|seconds|tests" per step, printed as a table at the very end

# The counts of a pytest step from its junit XML ("" when it wrote none: killed before the end).
pytest_counts() {
  local suite
  suite=$(grep -o '<testsuite [^>]*>' "$1" 2>/dev/null | head -n 1) || return 0
  [ -n "$suite" ] || return 0
  local n tests=0 failures=0 errors=0 skipped=0
  for n in tests failures errors skipped; do
    [[ $suite =~ \ $n=\"([0-9]+)\" ]] && printf -v "$n" '%s' "${BASH_REMATCH[1]}"
  done
  echo "$(( tests - failures - errors - skipped )) passed, $failures failed, $errors errors, $skipped skipped"
}

step() {  # step SECONDS NAME CMD...   (NAME: no spaces, it names the log)
  local limit=$1 name=$2
  shift 2
  local left
  left=$(time_left)
  if [ "$left" -lt 5 ]; then
    echo "=== $name: skipped, no time left before the 8-minute deadline"
    failed+=("$name (skipped: no time left)")
    summary+=("$name|SKIPPED (no time)|0|")
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "=== $name (limit ${limit} s)"
  local start=$SECONDS
  # The benchmarks turn SIGTERM into SystemExit (their rows are already in the CSV) and conftest.py
  # into KeyboardInterrupt (pytest still writes its summary and XML); --kill-after for the rest.
  echo "##### step $name" >> "$GPU_LOG"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$GPU_LOG"
  local rc=${PIPESTATUS[0]} secs=$((SECONDS - start)) status=ok
  echo "=== $name: exit $rc after $secs s"
  case $rc in
    0) ;;
    124|137) status="TIMEOUT (${limit} s)"; failed+=("$name (exit $rc)") ;;
    *) status="FAILED (exit $rc)"; failed+=("$name (exit $rc)") ;;
  esac
  summary+=("$name|$status|$secs|$(pytest_counts "$GPU_LOGS/$name.xml")")
}

pytest_step() {  # pytest_step SECONDS NAME [env ...] PY -m pytest ARGS...: a step, its results as XML too
  rm -f "$GPU_LOGS/$2.xml"  # a stale report must not be counted
  step "$@" "--junitxml=$GPU_LOGS/$2.xml"
}

# The probe, too, must fit the deadline (a wedged driver can hang it); with no time left at all,
# every step below reports itself skipped.
left=$(time_left)
if [ "$left" -ge 5 ]; then
  probe_limit=$(( left < 60 ? left : 60 ))
  timeout --kill-after=5 "$probe_limit" \
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA GPU visible')" \
    || { [ $? -lt 124 ] || echo "gpu-check: the CUDA probe did not answer within its limit ($probe_limit s)" >&2; exit 2; }
fi
# The csrc library is built here only (not by `make setup` as well), within the deadline. No nvcc
# (csrc/build.py looks where the build would) is no failure: the csrc tests then say so.
have_nvcc=0
if "$PY" csrc/build.py --find-nvcc >/dev/null 2>&1; then
  have_nvcc=1
  step 150 csrc_build "$PY" csrc/build.py
else
  echo "=== csrc_build: skipped, nvcc not found"
  summary+=("csrc_build|skipped (no nvcc)|0|")
fi
# Limits add up to more than the deadline leaves after setup and the csrc build: a step that runs
# long shortens the ones after it, never the whole run past 8 minutes.
step 30 info "$PY" -m overlapkernels info
# this triton's sm_90 code: vector peer stores, registers left for the flag kernels (seconds; no GPU use)
step 40 compile_sm90 env -u TRITON_INTERPRET "$PY" scripts/compile_kernels_sm90.py --quick
# kernels alone, the csrc library, ring attention on two processes
pytest_step 120 gpu_tests "${PYTEST[@]}" -m gpu --ignore=tests/test_ops_tp_gpu.py --ignore=tests/test_compile_gpu.py
step 90 bench_fused_gemm "$PY" benchmarks/bench_fused_gemm.py --csv "$GPU_CSV"
# several ranks spinning on flags on one GPU (symm/fused ops): the riskiest step, yet the one whose
# results are most wanted (two GPU runs hung in it), so before the other benchmarks, which a hang
# here shortens rather than it being cut short by them. No --maxfail: the process-world tests, last
# in the file, are the ones most worth the time; the step's limit bounds a run of hangs, and each
# test's world gives up after 30 s. 170 s: eager module loading in pytest and in each spawned rank,
# and ~20 kernel compiles, come before those tests.
pytest_step 170 gpu_tests_one_gpu "${EAGER[@]}" "${PYTEST[@]}" -m gpu tests/test_ops_tp_gpu.py
if [ "$have_nvcc" = 1 ]; then  # the csrc reduce: nothing to time without the library
  step 25 bench_reduce "$PY" benchmarks/bench_reduce.py --csv "$GPU_CSV"
else
  echo "=== bench_reduce: skipped, no CUDA library (no nvcc)"
  summary+=("bench_reduce|skipped (no nvcc)|0|")
fi
# what chunking a GEMM into per-rank pieces costs: the compute side of the CUDA auto threshold
step 40 bench_chunked_gemm "$PY" benchmarks/bench_chunked_gemm.py --csv "$GPU_CSV"
step 75 bench_flash_attn "$PY" benchmarks/bench_flash_attn.py --csv "$GPU_CSV"
step 50 bench_one_gpu_ag_matmul "${EAGER[@]}" "$PY" benchmarks/bench_one_gpu_ag_matmul.py --csv "$GPU_CSV"
# torch.compile (Inductor) through the ops on CUDA: last, since the Inductor build is the slowest
# start of all and its result matters least to the benchmarks before it
pytest_step 90 gpu_compile "${PYTEST[@]}" -m gpu tests/test_compile_gpu.py

echo "=== results: $GPU_CSV; log of every step: $GPU_LOG"
if [ ${#failed[@]} -gt 0 ]; then
  printf '=== FAILED: %s\n' "${failed[@]}"
fi
# Last, so the tail of the output always holds it.
echo "=== summary"
printf '%-24s %-20s %5s  %s\n' step status secs "tests (pytest)"
for row in "${summary[@]}"; do
  IFS='|' read -r name status secs tests <<<"$row"
  printf '%-24s %-20s %5s%s\n' "$name" "$status" "$secs" "${tests:+  $tests}"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "=== gpu-check: ${#failed[@]} step(s) failed"
  exit 1
fi
echo "=== gpu-check: all steps passed"
