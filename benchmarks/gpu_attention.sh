#!/usr/bin/env bash
# SageAttention on the GPU, one device call, the steps named as arguments (in the order given):
#   tests  the attention GPU tests (tests/kernels/test_sage_attention.py, tests/unit/attention; TEST_TIMEOUT, 240 s):
#          $OUT/junit_attention.xml and $OUT/tests.log;
#   bench  benchmarks/attention.py (route validation, autotune, the sweep against cuDNN/flash SDPA, the dispatch
#          table; BENCH_TIMEOUT, 420 s): benchmarks/results/attention.json (BENCH_ARGS="--name ..." for another
#          setting), neutrain/attention/dispatch_table.json (copied to $OUT) and $OUT/bench.log;
#   step   benchmarks/attention_train_step.py, the 8B training step with each attention (STEP_TIMEOUT, 300 s):
#          $OUT/train_step.json;
#   gluon  the Gluon warp-specialized forward (Hopper): its GPU tests (fidelity against the quantized reference
#          and fp32, LSE, backend routing, SASS of the device's compile; TEST_TIMEOUT, 120 s), then
#          benchmarks/diag/gluon_sage_smoke.py (Gluon with 1 and 2 consumer warpgroups against the Triton Sage
#          kernel and cuDNN SDPA at B=4, H=32, N=16K, d=128; SMOKE_TIMEOUT, 105 s): $OUT/junit_gluon_attention_<sha>.xml,
#          $OUT/gluon_tests.log, $OUT/smoke.log and gluon_sage_smoke.json; < 4 minutes, needs NEUTRAIN_GIT_COMMIT.
# Each step has its own timeout (a deadlocked kernel is killed with its process) and none stops the others.
#   OUT=/tmp/out NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) bash benchmarks/gpu_attention.sh [tests] [bench] [step] [gluon]
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
    gluon)
      source benchmarks/require_commit.sh
      short=${NEUTRAIN_GIT_COMMIT:0:7}
      python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0), torch.cuda.get_device_capability())"
      timeout "${TEST_TIMEOUT:-120}" python -m pytest -v -p no:cacheprovider -rs -m gpu tests/kernels/test_sage_attention_gluon.py \
        -s --junitxml="$OUT/junit_gluon_attention_$short.xml" \
        -o junit_suite_name="gluon-attention@$NEUTRAIN_GIT_COMMIT" >"$OUT/gluon_tests.log" 2>&1
      echo "gluon tests rc=$? (${SECONDS}s)"
      grep -E "^(FAILED|ERROR)|PASSED|FAILED|passed|failed|SKIPPED|regs" "$OUT/gluon_tests.log" | tail -45
      sed -n '/= FAILURES =/,/short test summary/p' "$OUT/gluon_tests.log" | grep -E "^E |Error|^____" | head -40
      tail -n 3 "$OUT/gluon_tests.log"  # after a timeout: the test that was running (-v names each one as it starts)
      timeout "${SMOKE_TIMEOUT:-105}" python benchmarks/diag/gluon_sage_smoke.py ${SMOKE_ARGS:-} >"$OUT/smoke.log" 2>&1
      echo "smoke rc=$? (${SECONDS}s)"
      tail -n 45 "$OUT/smoke.log" ;;
    *)
      echo "unknown step '$step': expected tests, bench, step or gluon" >&2; exit 2 ;;
  esac
done
echo "done in ${SECONDS}s"
