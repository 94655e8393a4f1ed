#!/usr/bin/env bash
# Issue 31, phase 1: ONE device call (< 4 min) for the Gluon warp-specialized SageAttention forward.
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=$(test -z "$(git status --porcelain)"; echo $?) \
#     bash benchmarks/gpu_issue31.sh
# 1. its GPU tests (fidelity vs the quantized reference and fp32, LSE, backend routing, SASS of the
#    device's compile; the offline-compile and CPU tests run on the CPU machines): junit under $OUT;
# 2. benchmarks/diag/gluon_sage_smoke.py: Gluon (1 and 2 consumer warpgroups) vs the Triton Sage kernel
#    vs cuDNN SDPA at B=4, H=32, N=16K, d=128, causal and not; JSON under $OUT.
# Each part has its own timeout (a deadlocked kernel is killed with its process) and neither stops the other.
set -u -o pipefail
source benchmarks/require_commit.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
OUT=${OUT:-/tmp/issue31_out}; mkdir -p "$OUT"
short=${NEUTRAIN_GIT_COMMIT:0:7}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv 2>&1 | tee "$OUT/nvsmi.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0), torch.cuda.get_device_capability())"
timeout "${TEST_TIMEOUT:-120}" python -m pytest -v -p no:cacheprovider -rs -m gpu tests/kernels/test_sage_attention_gluon.py \
  -s --junitxml="$OUT/junit_issue31_$short.xml" \
  -o junit_suite_name="issue31@$NEUTRAIN_GIT_COMMIT" >"$OUT/tests.log" 2>&1
echo "tests rc=$? (${SECONDS}s)"
grep -E "^(FAILED|ERROR)|PASSED|FAILED|passed|failed|SKIPPED|regs" "$OUT/tests.log" | tail -45
sed -n '/= FAILURES =/,/short test summary/p' "$OUT/tests.log" | grep -E "^E |Error|^____" | head -40
tail -n 3 "$OUT/tests.log"  # after a timeout: the test that was running (-v names each one as it starts)
timeout "${SMOKE_TIMEOUT:-105}" python benchmarks/diag/gluon_sage_smoke.py ${SMOKE_ARGS:-} >"$OUT/smoke.log" 2>&1
echo "smoke rc=$? (${SECONDS}s)"
tail -n 45 "$OUT/smoke.log"
echo "done in ${SECONDS}s"
