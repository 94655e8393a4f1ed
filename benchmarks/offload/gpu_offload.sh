#!/usr/bin/env bash
# Weight offload in one device call (one H100, < 10 minutes): the weight-offload GPU test (bit-identical training on CUDA),
# then benchmarks/offload/offload.py for the parts in PARTS (default: all; each part's time is printed).
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 OUT=/tmp/out bash benchmarks/offload/gpu_offload.sh
#   PARTS=link,8b ... ; then PARTS=70b BENCH_ARGS=--merge GPU_TESTS=0 ...   (two calls, one offload.json:
#   put the first call's offload.json into benchmarks/<topic>/results.jsonl of the tree the second call carries)
# Writes $OUT/junit_offload.xml, $OUT/offload.log and $OUT/offload.json (written again after each part:
# every part runs in its own process, so a CUDA fault in one is recorded as that part's `failed` line).
# NEUTRAIN_OFFLOAD_SYNC_DEBUG=1 (exported by the caller) syncs and checks the payload after each fetch,
# decode and write-back, naming the call that faulted (neutrain/nn/offload_debug.py); its timings are void.
# A failed part is rerun that way at the end (DEBUG_ON_FAIL=0: not), into $OUT/offload_sync_debug.{log,json}.
set -u
cd "$(dirname "$0")/../.."
source benchmarks/require_commit.sh
OUT=${OUT:-/tmp/neutrain-offload}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DISABLE_TQDM=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OUT
source benchmarks/install_carried_wheels.sh
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
free -g | head -2
if [ "${GPU_TESTS:-1}" = 1 ]; then
  timeout -k 5 "${TEST_LIMIT:-240}" python3 -m pytest -q tests/unit/nn/test_weight_offload_gpu.py -p no:cacheprovider \
    --junitxml="$OUT/junit_offload.xml" > "$OUT/junit_offload.log" 2>&1
  echo "tests rc=$? (${SECONDS}s)"; tail -n 15 "$OUT/junit_offload.log"
fi
# shellcheck disable=SC2086
timeout -k 5 "${BENCH_LIMIT:-540}" python3 benchmarks/offload/offload.py --parts "${PARTS:-link,8b,70b}" ${BENCH_ARGS:-} \
  > "$OUT/offload.log" 2>&1
echo "benchmark rc=$? (${SECONDS}s)"; tail -n 25 "$OUT/offload.log"
# A part that failed runs once more with NEUTRAIN_OFFLOAD_SYNC_DEBUG=1 (2 steps, no timeline): the log then
# names the fetch, decode or write-back (layer, weight, slot) that faulted or found a slot corrupted.
failed=$(python3 -c "import json, sys; print(','.join(json.load(open(sys.argv[1]))['settings']['failed_parts']))" \
  "$OUT/offload.json" 2>/dev/null)
if [ -n "$failed" ] && [ "${DEBUG_ON_FAIL:-1}" = 1 ]; then
  NEUTRAIN_OFFLOAD_SYNC_DEBUG=1 timeout -k 5 "${DEBUG_LIMIT:-150}" python3 benchmarks/offload/offload.py --parts "$failed" \
    --steps 2 --no-timeline --name offload_sync_debug > "$OUT/offload_sync_debug.log" 2>&1
  echo "sync-debug rerun of $failed rc=$? (${SECONDS}s)"
  grep -m 5 -E "OffloadFaultError|FAILED" "$OUT/offload_sync_debug.log"; tail -n 8 "$OUT/offload_sync_debug.log"
fi
free -g | head -2
echo "done in ${SECONDS}s"
