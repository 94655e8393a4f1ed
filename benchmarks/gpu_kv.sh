#!/usr/bin/env bash
# The KV-cache table in ONE device call on one H100, under 10 minutes (benchmarks/kv_eval.py --part all):
#   1. decode throughput at 32K and 64K on Llama-3-8B shapes, every row at the largest batch its own bytes allow
#      (benchmarks/_kv_sizing.py): full cache (timed under each SDPA backend, the fastest is the baseline, and
#      again at the end), ShadowKV (+ its step split), MiniCache merge + 4-bit / 4-bit only / merge through the
#      fused decode, merge + 4-bit through the restore path, the kvpress-pruned cache, QuantizedCache; each row
#      records its batch, the attention kernel that ran and the GPU's clocks, power and temperature around it;
#   2. the retrieval model (char Llama, 8 x 256) trained here for what the budget leaves, and every setting on
#      it: the methods, their pieces, QuantizedCache and kvpress SnapKV / StreamingLLM / ExpectedAttention at
#      4x (matched KV memory) when .whl/ carries kvpress, else those rows say why they are missing;
#   3. the real model (SmolLM2-135M-Instruct) when it is here (below), else the committed CPU record
#      (benchmarks/results/kv_eval_real.json), cited by commit;
#   then beside every throughput row its accuracy on both models (or the reason there is none) and the targets.
# Writes benchmarks/results/$NAME.json (+ $OUT/$NAME.json, $OUT/kv_eval.log; _partial after the throughput).
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 bash benchmarks/gpu_kv.sh
#   SMOKE=1 ... bash benchmarks/gpu_kv.sh   # CPU, stand-in shapes, the same path in well under a minute
# Wheels from .whl/ (install_carried_wheels.sh): kvpress, cachetools, fire, termcolor, datasets, dill,
# multiprocess, xxhash, optimum_quanto. The real model's GGUF (98 MB) is over what one call carries (64 MiB):
# split it into .carry/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf.part_* with a SHA256 file beside them, carry
# the parts in two calls to the same warm machine (a carried path stays there until a call names it again),
# and this script joins and checks them.
# Knobs: CALL_SECONDS (the whole script, default 570), TESTS=1 (first the KV GPU tests, TEST_LIMIT s, default
# 120, junit in $OUT), NAME (default kv_eval), STEPS (timed decode steps, default 6); extra arguments go to
# kv_eval.py.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
limit=${CALL_SECONDS:-570}
source benchmarks/require_commit.sh
source benchmarks/install_carried_wheels.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Growing stores (torch.cat per block) fragment the caching allocator; expandable segments map memory instead.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
OUT=${OUT:-/tmp/neutrain-kv}; mkdir -p "$OUT"
export OUT
name=${NAME:-kv_eval}
short=${NEUTRAIN_GIT_COMMIT:0:7}
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv,noheader
fi
python3 -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton', triton.__version__,
  'transformers', t.__version__)"
for pkg in kvpress optimum.quanto; do python3 -c "import $pkg" 2>/dev/null && echo "$pkg: here" || echo "$pkg: missing"; done

parts=(.carry/smollm2/*.gguf.part_*)
if [ -z "${NEUTRAIN_SMOLLM2_GGUF:-}" ] && [ -f "${parts[0]}" ]; then
  joined=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
  cat "${parts[@]}" > "$joined"
  if [ -f .carry/smollm2/SHA256 ] && [ "$(sha256sum < "$joined" | cut -d' ' -f1)" = "$(cut -d' ' -f1 .carry/smollm2/SHA256)" ]; then
    export NEUTRAIN_SMOLLM2_GGUF=$joined
    echo "real model: joined ${#parts[@]} parts"
  else
    echo "real model: the parts in .carry/smollm2 do not make the file in SHA256; the CPU record stands in"
  fi
fi

if [ "${TESTS:-0}" = 1 ]; then
  t0=$SECONDS
  timeout "${TEST_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu -rA \
    tests/kernels/test_minicache_attention.py tests/kernels/test_shadowkv.py \
    tests/unit/eval/test_minicache.py tests/unit/eval/test_shadowkv.py tests/unit/eval/test_diagnose.py \
    --junitxml="$OUT/junit_gpu_kv_$short.xml" -o junit_suite_name="gpu-kv@$NEUTRAIN_GIT_COMMIT" \
    > "$OUT/gpu_kv_tests.log" 2>&1
  echo "gpu kv tests rc=$? ($((SECONDS - t0)) s)"
  grep -E "^(PASSED|FAILED|ERROR)|max abs|passed|failed" "$OUT/gpu_kv_tests.log" | tail -25
fi

if [ "${SMOKE:-0}" = 1 ]; then
  run=(--smoke tiny)
  python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || export TRITON_INTERPRET=1  # kernels on CPU
else
  # Python's own budget: what is left of the call, less its start-up and the summary below.
  budget=$((limit - (SECONDS - start) - 35))
  run=(--budget-seconds "$budget" --contexts 32768 65536 --host-gib 64 --steps "${STEPS:-6}"
       --train-seconds 200 --stop-acc 0.95 --batch 64 --lr 1.5e-3 --samples 12 --diag-samples 4 --real-samples 10)
fi
log=$OUT/kv_eval.log
python3 benchmarks/kv_eval.py --part all --name "$name" "${run[@]}" "$@" > "$log" 2>&1
rc=$?
echo "kv_eval rc=$rc ($((SECONDS - start)) s); log $log"
grep -E "^(pinned|retrieval model:|targets:|real model)|Error|Traceback" "$log" | cut -c1-400
record=$OUT/$name.json
[ "${SMOKE:-0}" = 1 ] && record=$OUT/${name}_smoke.json
python3 - "$record" <<'EOF' || true
import json, sys

results = json.load(open(sys.argv[1]))["results"]
for ctx, rows in results.get("throughput", {}).get("contexts", {}).items():
    for label, row in rows.items():
        tps, speedup = row.get("tokens_per_s"), row.get("speedup_vs_full", 1.0 if label == "full" else None)
        after = (row.get("gpu_state") or {}).get("after") or {}
        acc = row.get("accuracy", {})

        def gaps(model):
            return ",".join(str(a.get("gap_points", "-")) for a in acc.get(model, [])) or "-"

        print(f"{ctx:>6} {label:30} batch {row.get('batch', '-'):>4} tok/s {tps or 0:8.1f} x full "
              f"{speedup if speedup is not None else float('nan'):5.2f} {row.get('attention_kernel') or '-':28} "
              f"sm {after.get('sm_clock_mhz') or '-'} MHz {after.get('power_w') or '-'} W  gap retrieval "
              f"{gaps('retrieval_model')} real {gaps('real_model')} {(row.get('error') or row.get('skipped') or '')[:70]}")
    for ctx_row in ("shadowkv",):
        split = rows.get(ctx_row, {}).get("step_split")
        if split:
            print(f"{ctx:>6} shadowkv step split (ms): {split}")
EOF
echo "done in $((SECONDS - start)) s"
exit "$rc"
