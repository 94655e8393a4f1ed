#!/usr/bin/env bash
# One device call, about 7 minutes on one H100: the two GPU tests whose limits or keys changed, the 8B
# recipe's loss curve under a few optimizer settings (benchmarks/training/recipe_learning.py, five runs at once),
# and whether a resume under weight offload is bit-exact (benchmarks/offload/resume_offload_gpu.py), the last
# two side by side. Writes junit, recipe_learning.json and resume_offload.json under $OUT.
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 bash benchmarks/cards/gpu_card_diagnostics.sh
set -u
cd "$(dirname "$0")/../.."
source benchmarks/require_commit.sh
OUT=${OUT:-/tmp/neutrain-diag-out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 DISABLE_TQDM=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
source benchmarks/install_carried_wheels.sh > /dev/null
cp neutrain-recipe.pth "$(python3 -c 'import site; print(site.getsitepackages()[0])')/"
[ -n "${SKIP_TESTS:-}" ] || timeout -k 5 150 python3 -m pytest -q -x --junitxml="$OUT/junit_card_diagnostics.xml" \
  tests/unit/nn/test_phase_memory_gpu.py "tests/unit/speculative/test_engine_gpu.py::test_graph_replayed_greedy_equals_hf_greedy" \
  -s 2>&1 | grep -E "largest matrices|passed|failed|Error|assert" | tail -20
S="memory.stochastic_rounding"
timeout -k 5 330 python3 benchmarks/training/recipe_learning.py --limit 320 --steps 22 \
  --setting "train.learning_rate=1e-3" --setting "train.learning_rate=0.1" --setting "train.learning_rate=0.3" \
  --setting "train.learning_rate=0.1 $S=false" --setting "train.optimizer=adalomo train.learning_rate=0.1" \
  > "$OUT/recipe_learning.out" 2>&1 &
timeout -k 5 330 python3 benchmarks/offload/resume_offload_gpu.py > "$OUT/resume_offload.out" 2>&1
wait
cat "$OUT/resume_offload.out" "$OUT/recipe_learning.out"
for f in /tmp/resume-offload/*.log /tmp/neutrain-recipe-learning/*.log; do  # the end of any failed launch
  grep -q "Error\|error:" "$f" 2>/dev/null && { echo "== $f"; grep -v "^\s" "$f" | tail -4; }
done
echo "done in ${SECONDS}s"
