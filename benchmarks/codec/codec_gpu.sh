#!/usr/bin/env bash
# One device call for the codec (< 9 minutes; run from the repository root of a carried copy):
# benchmark first (an idle GPU; benchmarks/codec/results.jsonl#codec), then the GPU tests of the codec and of
# compressed training, each with its log and junit XML under $OUT ($OUT/codec_bench.log, junit_codec.xml,
# codec_tests.log). Needs NEUTRAIN_GIT_COMMIT and NEUTRAIN_GIT_DIRTY.
set -o pipefail
source benchmarks/install_carried_wheels.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout "${CODEC_BENCH_TIMEOUT:-240}" python3 benchmarks/codec/codec.py 2>&1 | tee "$OUT/codec_bench.log"
echo "benchmark exit: $?"
timeout "${CODEC_TEST_TIMEOUT:-270}" python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_codec.py tests/unit/compress tests/unit/nn tests/integration/test_compressed_training.py \
  --junitxml="$OUT/junit_codec.xml" -o junit_suite_name="codec@${NEUTRAIN_GIT_COMMIT}" 2>&1 | tail -40 | tee "$OUT/codec_tests.log"
echo "tests exit: $?"
