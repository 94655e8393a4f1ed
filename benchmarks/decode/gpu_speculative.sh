#!/usr/bin/env bash
# Speculative decoding in one device call on one H100: benchmarks/decode/speculative.py at full size -- the 8B engine decode
# (benchmarks/decode/engine_decode.py, in a subprocess), the ~300M target, both drafts, every decode row -- under
# a hard time budget so that the whole call ends in < 9.5 minutes. speculative.json, engine_decode.json and
# speculative.log land in $OUT; the records are rows of benchmarks/decode/results.jsonl too.
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 bash benchmarks/decode/gpu_speculative.sh [extra args]
# Extra arguments go to benchmarks/decode/speculative.py (e.g. --target-seconds 120 --big-layers 16 for a shorter call).
# Nothing here needs the carried wheels (neutrain.data's python-stdlib corpus does not import datasets).
set -u
cd "$(dirname "$0")/../.."
source benchmarks/require_commit.sh
OUT=${OUT:-/tmp/neutrain-speculative}
mkdir -p "$OUT"
export OUT PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 DISABLE_TQDM=1 NCCL_NVLS_ENABLE=0
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
# The Python budget (--budget-s, default 520 s) skips late rows and writes the JSON; the timeout is the backstop.
timeout -k 10 "${SPEC_LIMIT:-555}" python3 benchmarks/decode/speculative.py --budget-s "${SPEC_BUDGET:-520}" "$@" 2>&1 | tee "$OUT/speculative.log"
rc=${PIPESTATUS[0]}
echo "speculative.py rc=$rc (${SECONDS}s)"
exit "$rc"
