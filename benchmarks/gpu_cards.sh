#!/usr/bin/env bash
# Issue 27's cards gate in one device call: benchmarks/cards.py runs the literal user commands (accelerate
# launch recipes/llama3_8b.yaml ..., neutrain generate ...) at budgets of 22, 14.5, 11 and 7 GiB, then the
# targets' timing runs, and merges $OUT/cards.json.
# On a machine of two GPUs (what one call's time allows): GPU 0 runs the 7 and 14.5 GiB journeys at once,
# then the batch-8 pair (no budget, 7 GiB) alone; GPU 1 runs 11 and 22 GiB at once, then the recipe-batch
# pair (no budget, 11 GiB) alone. Each process's allocated/reserved peaks are its own; the NVML device
# figure of a shared GPU counts both journeys (the timing runs give the clean ones).
# Disk: a journey holds up to ~46 GiB (three 10 GiB checkpoints and a 15 GiB export) until it is cleaned:
# the offloaded journeys (7, 11) work in /dev/shm, the others on disk.
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 bash benchmarks/gpu_cards.sh
set -u
cd "$(dirname "$0")/.."
source benchmarks/require_commit.sh
OUT=${OUT:-/tmp/neutrain-cards-out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 DISABLE_TQDM=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
source benchmarks/install_carried_wheels.sh > /dev/null
# What `pip install` gives a user and the device copy lacks: the recipe codec (`accelerate launch recipe.yaml`)
# and the `neutrain` command.
cp neutrain-recipe.pth "$(python3 -c 'import site; print(site.getsitepackages()[0])')/"
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m neutrain "$@"\n' > /tmp/bin/neutrain && chmod +x /tmp/bin/neutrain
export PATH=/tmp/bin:$PATH
JOURNEY=${JOURNEY_LIMIT:-380}
TIMING=${TIMING_LIMIT:-150}
cards() { timeout -k 5 "$1" python3 benchmarks/cards.py --part "$2" --budgets "$3" --timing "$4" --work "$5" > "$OUT/cards_$2.out" 2>&1; }
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$ngpu" -ge 2 ]; then
  ( export CUDA_VISIBLE_DEVICES=0
    cards "$JOURNEY" j7 7 "" /dev/shm/cards7 & cards "$JOURNEY" j14 14.5 "" /tmp/cards14 & wait
    cards "$TIMING" t8 "" b8_none,b8_7 /tmp/cards_t8 ) &
  ( export CUDA_VISIBLE_DEVICES=1
    cards "$JOURNEY" j11 11 "" /dev/shm/cards11 & cards "$JOURNEY" j22 22 "" /tmp/cards22 & wait
    cards "$TIMING" t1 "" b1_none,b1_11 /tmp/cards_t1 ) &
  wait
  parts=("$OUT"/cards_j7.json "$OUT"/cards_j14.json "$OUT"/cards_j11.json "$OUT"/cards_j22.json "$OUT"/cards_t8.json "$OUT"/cards_t1.json)
else
  cards 3000 all 22,14.5,11,7 b1_none,b1_11,b8_none,b8_7 /tmp/cards
  parts=("$OUT/cards_all.json")
fi
tail -n 4 "$OUT"/cards_*.out
python3 benchmarks/cards.py --merge "${parts[@]}"
echo "done in ${SECONDS}s"
