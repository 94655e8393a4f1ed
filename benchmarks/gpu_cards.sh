#!/usr/bin/env bash
# Issue 27's cards gate in one device call: benchmarks/cards.py runs the literal user commands (accelerate
# launch recipes/llama3_8b.yaml ..., neutrain generate ...) at budgets of 22, 14.5, 11 and 7 GiB, then the
# timing runs of the targets, and merges $OUT/cards.json. On a machine of two GPUs the budgets are shared
# out, each budget (and each ratio's pair of runs) on one card: GPU 0 takes 7 and 14.5 GiB and the batch-8
# pair, GPU 1 takes 11 and 22 GiB and the unbounded recipe batch (the 11 GiB run's own steps are its pair).
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 bash benchmarks/gpu_cards.sh
set -u
cd "$(dirname "$0")/.."
source benchmarks/require_commit.sh
OUT=${OUT:-/tmp/neutrain-cards-out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 DISABLE_TQDM=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
source benchmarks/install_carried_wheels.sh
# What `pip install` gives a user and the device copy lacks: the recipe codec (`accelerate launch recipe.yaml`)
# and the `neutrain` command.
cp neutrain-recipe.pth "$(python3 -c 'import site; print(site.getsitepackages()[0])')/"
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m neutrain "$@"\n' > /tmp/bin/neutrain && chmod +x /tmp/bin/neutrain
export PATH=/tmp/bin:$PATH
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
LIMIT=${CARDS_LIMIT:-540}
if [ "$ngpu" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 "$LIMIT" python3 benchmarks/cards.py --part gpu0 --budgets 7,14.5 \
    --timing b8_none,b8_7 --work /tmp/cards0 > "$OUT/cards_gpu0.out" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout -k 5 "$LIMIT" python3 benchmarks/cards.py --part gpu1 --budgets 11,22 \
    --timing b1_none --work /tmp/cards1 > "$OUT/cards_gpu1.out" 2>&1 &
  wait
  parts=("$OUT/cards_gpu0.json" "$OUT/cards_gpu1.json")
else
  timeout -k 5 "$LIMIT" python3 benchmarks/cards.py --part gpu0 > "$OUT/cards_gpu0.out" 2>&1
  parts=("$OUT/cards_gpu0.json")
fi
tail -n 8 "$OUT"/cards_gpu*.out
python3 benchmarks/cards.py --merge "${parts[@]}"
echo "done in ${SECONDS}s"
