#!/usr/bin/env bash
# One device call for issue 18: GPU attention tests (junit), then the attention benchmark
# (route validation, autotune, sweep, dispatch table, optionally the 8B training step).
#   OUT=/tmp/out NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) bash benchmarks/attention_gpu.sh [tests] [bench] [step]
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
OUT=${OUT:-/tmp/attention_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv >"$OUT/nvsmi.txt" 2>&1
for step in "$@"; do
  case $step in
    tests)
      timeout "${TEST_TIMEOUT:-240}" python -m pytest -q -p no:cacheprovider tests/kernels/test_sage_attention.py \
        tests/unit/attention --junitxml="$OUT/junit_attention.xml" -o junit_suite_name="attention@${NEUTRAIN_GIT_COMMIT:-unknown}" \
        >"$OUT/tests.log" 2>&1
      echo "tests rc=$?"; grep -E "passed|failed|error" "$OUT/tests.log" | tail -3 ;;
    bench)
      timeout "${BENCH_TIMEOUT:-420}" python benchmarks/attention.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -vE "^\{" | tail -60
      cp neutrain/attention/dispatch_table.json "$OUT/" 2>/dev/null ;;
    step)
      timeout "${STEP_TIMEOUT:-300}" python benchmarks/attention_train_step.py ${STEP_ARGS:-} --out "$OUT/train_step.json" 2>&1 | tail -5 ;;
  esac
done
