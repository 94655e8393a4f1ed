#!/usr/bin/env bash
# One device call (< 10 minutes: CALL_SECONDS, 570) for train_memory.py, run from the repository root of a carried copy:
# the benchmark first (an idle GPU: neutrain's variants and the peers, each in its own process),
# then, in the time left, the GPU tests of tests/kernels and tests/integration and the whole codec
# test file on the GPU (real Triton: the grouped kernels' bytes against the reference), each with
# its junit XML under $OUT. Needs NEUTRAIN_GIT_COMMIT and NEUTRAIN_GIT_DIRTY; wheels in .whl/.
set -o pipefail
source benchmarks/install_carried_wheels.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -m pip list 2>/dev/null | grep -i -E "^(torch|torchao|bitsandbytes|lomo.optim|transformers) "
python3 benchmarks/memory/train_memory.py --variants "${VARIANTS:-d,c,t,f,e,h,p,g}" --budget "${BUDGET:-330}" \
  --timeout "${CHILD_TIMEOUT:-130}" 2>&1 | tee "$OUT/train_memory.log"
echo "benchmark exit: $?"
left=$(( ${CALL_SECONDS:-570} - SECONDS ))
echo "seconds left for tests: $left"
timeout $(( left * 2 / 3 )) python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels tests/integration \
  --junitxml="$OUT/junit_gpu_kernels_integration.xml" -o junit_suite_name="gpu@${NEUTRAIN_GIT_COMMIT}" 2>&1 | tail -15
echo "gpu tests exit: $?"
left=$(( ${CALL_SECONDS:-570} - SECONDS ))
timeout "$left" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_codec.py \
  --junitxml="$OUT/junit_codec_on_gpu.xml" -o junit_suite_name="codec-gpu@${NEUTRAIN_GIT_COMMIT}" 2>&1 | tail -8
echo "codec tests exit: $?"
