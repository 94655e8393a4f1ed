#!/usr/bin/env bash
# The fit's levers on a GPU (one H100 or H200): the 12 GB card's speed, the 6 GB card's whole journey, and the
# planner by phase beside what each run measured. Needs a build path that puts memory.offload_layers' layers
# (and only those) in host memory: each run's log must say "memory.offload_weights: N layers" with the N the
# fit chose ("memory: offloading N of 32 decoder layers' weights"); NeuTrainer warns "memory.offload_layers:
# K asked, but the build put N ..." where it does not, and this script prints both lines.
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 OUT=/tmp/out bash benchmarks/gpu_fit.sh
#   PARTS=tests,timing (~5 min) then PARTS=journey (~6 min): two calls, each under 10 minutes.
# tests:   tests/unit/nn/test_weight_offload_gpu.py (some layers offloaded on CUDA train bit-identically).
# timing:  benchmarks/cards.py timing b1_none and b1_11 (batch 1, no budget and 11 GiB, 10 steps each):
#          card_12gb_over_unbounded_tokens_per_s = b1_11 / b1_none (goal >= 0.95).
# journey: benchmarks/cards.py at 5.0 GiB (train 22, resume 20->22 + hf export, generate):
#          card_6gb_whole_run_ok (every command rc 0).
# Then the largest |predicted / measured - 1| of each phase's peak reserved over the runs (goal <= 0.10).
set -u
cd "$(dirname "$0")/.."
source benchmarks/require_commit.sh
OUT=${OUT:-/tmp/neutrain-fit}
PARTS=${PARTS:-tests,timing,journey}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 DISABLE_TQDM=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
source benchmarks/install_carried_wheels.sh > /dev/null
# What `pip install` gives a user and the device copy lacks: the recipe codec and the `neutrain` command.
cp neutrain-recipe.pth "$(python3 -c 'import site; print(site.getsitepackages()[0])')/"
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m neutrain "$@"\n' > /tmp/bin/neutrain && chmod +x /tmp/bin/neutrain
export PATH=/tmp/bin:$PATH
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
neutrain estimate recipes/llama3_8b.yaml memory.device_budget_gib=11 | grep -E "^(memory|chosen|decoder layers)"
if [[ ,$PARTS, == *,tests,* ]]; then
  timeout -k 5 "${TEST_LIMIT:-150}" python3 -m pytest -q tests/unit/nn/test_weight_offload_gpu.py -p no:cacheprovider \
    --junitxml="$OUT/junit_offload_fit.xml" > "$OUT/junit_offload_fit.log" 2>&1
  echo "tests rc=$? (${SECONDS}s)"; tail -n 5 "$OUT/junit_offload_fit.log"
fi
if [[ ,$PARTS, == *,timing,* ]]; then
  timeout -k 5 "${TIMING_LIMIT:-300}" python3 benchmarks/cards.py --part t1 --budgets "" --timing b1_none,b1_11 \
    --work /tmp/cards_t1 --limit 140 > "$OUT/cards_t1.out" 2>&1
  echo "timing rc=$? (${SECONDS}s)"; tail -n 2 "$OUT/cards_t1.out"
fi
if [[ ,$PARTS, == *,journey,* ]]; then
  timeout -k 5 "${JOURNEY_LIMIT:-560}" python3 benchmarks/cards.py --part j5 --budgets 5 --timing "" \
    --work /dev/shm/cards5 --limit 250 > "$OUT/cards_j5.out" 2>&1
  echo "journey rc=$? (${SECONDS}s)"; tail -n 2 "$OUT/cards_j5.out"
  rm -rf /dev/shm/cards5
fi
grep -h -E "memory.offload_weights: [0-9]+ layers|memory.offload_layers: |^memory: " "$OUT"/cards_*.log 2>/dev/null | sort | uniq -c
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
records = [json.loads(p.read_text()) for p in (out / "cards_t1.json", out / "cards_j5.json") if p.exists()]
timing = {k: v for r in records for k, v in r["timing"].items()}
if timing.get("b1_none", {}).get("tokens_per_s") and timing.get("b1_11", {}).get("tokens_per_s"):
    print("card_12gb_over_unbounded_tokens_per_s", round(timing["b1_11"]["tokens_per_s"] / timing["b1_none"]["tokens_per_s"], 3),
          "choice:", (timing["b1_11"].get("choice") or {}).get("choice"))
for budget in (b for r in records for b in r["budgets"]):
    print("card_6gb_whole_run_ok", budget.get("ok"), {k: c["rc"] for k, c in budget.get("commands", {}).items()},
          "choice:", (budget.get("choice") or {}).get("choice"))
errors = []
for where, phases in [(name, t.get("phases", {})) for name, t in timing.items()] + \
                     [(f"{b['budget_gib']:g} GiB", b.get("phases", {})) for r in records for b in r["budgets"]]:
    for phase, e in phases.items():
        measured, predicted = e["measured"].get("reserved_gib"), e["predicted"].get("reserved_gib")
        if measured and predicted:
            errors.append((abs(predicted / measured - 1), where, phase, round(predicted, 2), round(measured, 2)))
for error in sorted(errors, reverse=True)[:6]:
    print("planner reserved error %.3f  %s %s: predicted %.2f, measured %.2f" % error)
PY
echo "done in ${SECONDS}s"
