#!/usr/bin/env bash
# Training on the GPU: the whole GPU test suite, the codec, and what a training step costs in memory and
# time, one PART per device call (each part's time limits below), run from the repository root with $OUT set:
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 PART=tests bash benchmarks/training/gpu_training.sh
#   PART=tests   every GPU-marked test of tests/unit, tests/kernels, tests/integration (the SDPA-backend
#                matrix excepted: PART=sdpa) (TEST_LIMIT, 330 s; TEST_WORKERS processes, 4, one a file). Writes $OUT/junit_gpu_<sha>.xml (the GPU
#                suite's record: `python benchmarks/records.py add` folds it into benchmarks/gpu_tests.jsonl) and gpu_tests.log.
#   PART=sdpa    compressed training = dense under each SDPA backend, 16 architectures (SDPA_LIMIT, 120 s).
#                Writes $OUT/junit_sdpa_backends_<sha>.xml.
#   PART=codec   the codec test file on the GPU (120 s), then benchmarks/codec/codec.py (170 s). Writes
#                $OUT/junit_codec_<sha>.xml, codec_bench.log and codec.json.
#   PART=memory  benchmarks/memory/train_memory.py: neutrain's variants and the peers (wheels in .whl/, bitsandbytes'
#                also in .carry/bnb/), one process each, within BUDGET (450 s). Writes train_memory.json
#                (docs/memory.md's table). Beside another benchmark on a two-GPU machine, give each its GPU
#                with CUDA_VISIBLE_DEVICES: the device-used figures follow it (torch maps it to NVML's index).
#   PART=70b     benchmarks/memory/train_70b.py at 16K and 32K tokens (an H200). Writes train_70b.json.
# PART may list several, run in order: PART=tests,sdpa,codec. Each JSON lands in benchmarks/<topic>/results.jsonl and is
# copied to $OUT.
set -o pipefail
source benchmarks/require_commit.sh
source benchmarks/install_carried_wheels.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
short=${NEUTRAIN_GIT_COMMIT:0:7}
run_part() {
case "$1" in
  tests)
    # Several workers, a test file each at a time (pytest-xdist, in the image): a fresh machine spends most of the
    # suite compiling Triton kernels (measured on an H200, one process: 88 % of it in 500 s cold, all of it in 177 s warm), and the
    # workers compile side by side. Each test's memory figures are its own process's allocator's, and NVML's
    # device-used figure is only checked to exceed them, so the workers do not disturb one another.
    workers=()
    python3 -c "import xdist" 2>/dev/null && [ "${TEST_WORKERS:-4}" -gt 1 ] && workers=(-n "${TEST_WORKERS:-4}" --dist loadfile)
    timeout "${TEST_LIMIT:-330}" python3 -m pytest -v -p no:cacheprovider "${workers[@]}" -m gpu tests/unit tests/kernels \
      tests/integration -k "not sdpa_backend" --durations=15 --junitxml="$OUT/junit_gpu_$short.xml" \
      -o junit_suite_name="gpu@$NEUTRAIN_GIT_COMMIT" > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$? (${SECONDS}s)"; grep -E "FAILED|^ERROR|passed|failed" "$OUT/gpu_tests.log" | sort -u | tail -25 ;;
  sdpa)
    timeout "${SDPA_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/integration/test_architectures.py \
      -k sdpa_backend --junitxml="$OUT/junit_sdpa_backends_$short.xml" \
      -o junit_suite_name="sdpa_backends@$NEUTRAIN_GIT_COMMIT" > "$OUT/sdpa_backends.log" 2>&1
    echo "sdpa backends rc=$? (${SECONDS}s)"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/sdpa_backends.log" | tail -10 ;;
  codec)
    timeout "${CODEC_TEST_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_codec.py \
      --junitxml="$OUT/junit_codec_$short.xml" -o junit_suite_name="codec-gpu@$NEUTRAIN_GIT_COMMIT" 2>&1 | tail -4
    timeout "${CODEC_BENCH_LIMIT:-170}" python3 benchmarks/codec/codec.py > "$OUT/codec_bench.log" 2>&1
    echo "codec bench rc=$? (${SECONDS}s)"; tail -n 6 "$OUT/codec_bench.log" ;;
  memory)
    python3 benchmarks/memory/train_memory.py --variants "${VARIANTS:-d,c,h,t,p,q,x,e,f}" --budget "${BUDGET:-450}" \
      --timeout "${CHILD_TIMEOUT:-130}" --profile "${PROFILE:-c,d}" ${CLIP:+--clip-mode "$CLIP"} 2>&1 | tee "$OUT/train_memory.log" | tail -40 ;;
  70b)
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    python3 benchmarks/memory/train_70b.py --seqs "${SEQS:-16384,32768}" --fallback 0 --offload-seqs 32768 ${CLIP:+--clip-mode "$CLIP"} \
      2>&1 | tee "$OUT/train_70b.log" | tail -30 ;;
  *) echo "gpu_training.sh: unknown PART '$1' (tests, sdpa, codec, memory, 70b)" >&2; return 2 ;;
esac
}
IFS=, read -ra parts <<< "${PART:?PART=tests|sdpa|codec|memory|70b, or a comma list}"
status=0
for part in "${parts[@]}"; do run_part "$part" || status=$?; done
echo "done in ${SECONDS}s"
exit $status
