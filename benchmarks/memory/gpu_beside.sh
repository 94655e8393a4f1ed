#!/usr/bin/env bash
# Short GPU jobs on a GPU the 70B whole run (gpu_70b_recipe.sh) leaves free: on a 2-GPU machine that run holds
# GPU 0 for ~25 minutes and needs GPU 1 only for its side-by-side generate, so the minutes between can measure
# other things. Each job has its own time limit; none stops the next. Everything lands in $OUT/beside.tgz
# (a call returns 8 files). From the repository root:
#   CUDA_VISIBLE_DEVICES=1 BESIDE_LIMIT=480 bash benchmarks/memory/gpu_beside.sh packed determinism engine
# Jobs:
#   packed       the GPU tests of the packed-rows attention, export placements and the compiled decode layers (junit)
#   determinism  benchmarks/training/determinism.py --part timing (sdpa against neutrain_sdpa, default and deterministic)
#   engine       gpu_serving.sh PARTS=engine (dense and NeuZip-lossless decode on Llama-3-8B shapes)
#   rounds       gpu_serving.sh PARTS=rounds (a speculative round's split)
#   sage         gpu_attention.sh gluon (the Gluon Sage forward's tests and its smoke timing)
#   suite        the GPU-marked unit and kernel tests (gpu_training.sh PART=tests, 4 workers)
#   decode       benchmarks/decode/decode_profile.py (the dense and zgemv 8B decode step's kernel table and gaps)
# BESIDE_LIMIT (s) bounds the whole list: a job that would start with less than 60 s left is not started.
set -u
cd "$(dirname "$0")/../.."
source benchmarks/install_carried_wheels.sh > /dev/null 2>&1  # what the image lacks (datasets, gguf, ...)
CALL_OUT=${OUT:-/tmp/neutrain-beside}
WORK=/tmp/neutrain-beside; mkdir -p "$WORK" "$CALL_OUT"
export OUT=$WORK PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 DISABLE_TQDM=1
export TOKENIZERS_PARALLELISM=false
LIMIT=${BESIDE_LIMIT:-480}
left() { echo $(( LIMIT - SECONDS )); }
short=${NEUTRAIN_GIT_COMMIT:-unknown}; short=${short:0:7}
for job in "$@"; do
  t=$(left)
  if [ "$t" -lt 60 ]; then echo "beside: $job not started ($t s left)"; continue; fi
  t0=$SECONDS
  case $job in
    packed)
      timeout -k 5 "$(( t < 180 ? t : 180 ))" python3 -m pytest -q -p no:cacheprovider -rfEs \
        tests/unit/attention/test_packed_attention.py tests/unit/export/test_export_placements.py \
        tests/unit/decode/test_compiled_layers.py tests/unit/decode/test_fused_projections.py \
        --junitxml="$WORK/junit_gpu_packed_$short.xml" -o junit_suite_name="gpu-packed@${NEUTRAIN_GIT_COMMIT:-unknown}" \
        > "$WORK/packed_tests.log" 2>&1
      rc=$?; tail -n 4 "$WORK/packed_tests.log" ;;
    determinism)
      timeout -k 5 "$(( t < 300 ? t : 300 ))" python3 benchmarks/training/determinism.py --part timing > "$WORK/determinism.log" 2>&1
      rc=$?; tail -n 25 "$WORK/determinism.log" ;;
    engine)
      PARTS=engine WEIGHTS=dense,neuzip-lossless ENGINE_BUDGET=150 ENGINE_LIMIT=$(( t < 240 ? t : 240 )) \
        bash benchmarks/decode/gpu_serving.sh > "$WORK/engine.log" 2>&1
      rc=$?; tail -n 30 "$WORK/engine.log" ;;
    rounds)
      PARTS=rounds bash benchmarks/decode/gpu_serving.sh > "$WORK/rounds.log" 2>&1
      rc=$?; tail -n 20 "$WORK/rounds.log" ;;
    sage)
      SMOKE_TIMEOUT=$(( t < 150 ? t - 30 : 120 )) bash benchmarks/attention/gpu_attention.sh gluon > "$WORK/sage.log" 2>&1
      rc=$?; tail -n 30 "$WORK/sage.log"; cat "$WORK/smoke.log" 2>/dev/null | tail -n 30 ;;
    decode)
      timeout -k 5 "$(( t < 420 ? t : 420 ))" python3 benchmarks/decode/decode_profile.py --out "$WORK/decode_profile" \
        > "$WORK/decode_profile.log" 2>&1
      rc=$?; tail -n 40 "$WORK/decode_profile.log" ;;
    suite)
      PART=tests TEST_LIMIT=$(( t - 20 )) TEST_WORKERS=4 bash benchmarks/training/gpu_training.sh > "$WORK/suite.log" 2>&1
      rc=$?; tail -n 30 "$WORK/suite.log" ;;
    *) echo "beside: unknown job $job"; rc=2 ;;
  esac
  echo "beside: $job rc=$rc in $(( SECONDS - t0 )) s"
done
python3 benchmarks/records.py current determinism > "$WORK/determinism.json" 2>/dev/null
tar -czf "$CALL_OUT/beside.tgz" -C "$(dirname "$WORK")" "$(basename "$WORK")"
