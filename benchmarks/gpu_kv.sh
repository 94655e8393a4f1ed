#!/usr/bin/env bash
# KV caches on the GPU: their GPU tests and decode throughput at long contexts, in ONE device call
# (< 6 minutes; run from the repository root; .whl/ carried for optimum-quanto, else the QuantizedCache
# row records it as unavailable). The whole KV evaluation (accuracy too) is benchmarks/gpu_kv_eval.sh.
#   1. the GPU tests of the KV code (MiniCache's fused decode kernel against its reference and against the
#      restore path, the ShadowKV gather and its mixed batch), junit in $OUT/junit_gpu_kv_<sha>.xml;
#   2. decode throughput at 32K and 64K on Llama-3-8B shapes (benchmarks/kv_eval.py --part throughput): full,
#      ShadowKV (+ its step split: selection, gather, reconstruction, attention, the rest), MiniCache merge +
#      4-bit / 4-bit only / merge with the fused decode, merge + 4-bit through the old restore path, the
#      kvpress-pruned cache and QuantizedCache, each batch sized by its own KV bytes under the same GPU budget.
#      Writes benchmarks/results/$NAME.json (copied to $OUT) and $OUT/kv_throughput.log.
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 bash benchmarks/gpu_kv.sh
# Knobs: TEST_LIMIT (s, default 150), BUDGET (the throughput run's own budget, s, default 220), NAME
# (default kv_eval_throughput), STEPS (timed decode steps, default 6). A failing part does not stop the other.
set -o pipefail
source benchmarks/require_commit.sh
source benchmarks/install_carried_wheels.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/neutrain-kv}; mkdir -p "$OUT"
short=${NEUTRAIN_GIT_COMMIT:0:7}
name=${NAME:-kv_eval_throughput}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton', triton.__version__,
  'transformers', t.__version__)"

t0=$SECONDS
timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu -rA \
  tests/kernels/test_minicache_attention.py tests/kernels/test_shadowkv.py \
  tests/unit/eval/test_minicache.py tests/unit/eval/test_shadowkv.py tests/unit/eval/test_diagnose.py \
  --junitxml="$OUT/junit_gpu_kv_$short.xml" -o junit_suite_name="gpu-kv@$NEUTRAIN_GIT_COMMIT" \
  > "$OUT/gpu_kv_tests.log" 2>&1
echo "gpu kv tests rc=$? ($((SECONDS - t0)) s)"
grep -E "^(PASSED|FAILED|ERROR)|max abs|passed|failed" "$OUT/gpu_kv_tests.log" | tail -25

t1=$SECONDS
timeout 330 python3 benchmarks/kv_eval.py --part throughput --name "$name" --contexts 32768 65536 \
  --host-gib 64 --steps "${STEPS:-6}" --budget-seconds "${BUDGET:-220}" > "$OUT/kv_throughput.log" 2>&1
echo "throughput rc=$? ($((SECONDS - t1)) s)"
grep -E "^ctx |pinned|Error|error|Traceback" "$OUT/kv_throughput.log" | cut -c1-700
cp "benchmarks/results/$name.json" "$OUT/" 2>/dev/null || echo "no benchmarks/results/$name.json"
python3 - "$OUT/$name.json" <<'EOF' || true
import json, sys
rows = json.load(open(sys.argv[1]))["results"]["throughput"]["contexts"]
for ctx, r in rows.items():
    full = r.get("full", {}).get("tokens_per_s")
    for label, row in r.items():
        tps = row.get("tokens_per_s")
        print(f"{ctx:>6} {label:30} batch {row.get('batch', '-'):>4} tok/s {tps or 0:8.1f} "
              f"x full {(tps / full) if tps and full else float('nan'):5.2f} {row.get('error', '')[:80]}")
    split = r.get("shadowkv", {}).get("step_split")
    if split:
        print(f"{ctx:>6} shadowkv step split (ms): {split}")
EOF
echo "done in ${SECONDS}s"
