#!/usr/bin/env bash
# The cards gate on the device: benchmarks/cards/cards.py runs the literal user commands (accelerate launch
# recipes/llama3_8b.yaml ..., neutrain generate ...) at device budgets of 22, 14.5, 11 and 7 GiB (24, 16,
# 12 and 8 GB cards; 5 GiB for a 6 GB card), then the targets' timing runs, and merges $OUT/cards.json.
# Every journey and timing run is alone on its GPU (clean NVML figures); with two GPUs the two lists run
# side by side. A journey takes about 4-5 minutes on an H100 (two launches, three 10 GiB saves, the
# 15 GiB hf export, two generates); a timing run about 1.5. The timing runs (cards.py's TIMING): the shipped
# recipe (memory.weights: auto) with no budget and at 11, 7 and 5 GiB, at batch 1 and 8 (b1_none ... b8_5),
# and dense weights with no budget at batch 1 (b1_dense); each records the fit's predicted tok/s beside its own.
#   STAGE=journeys: GPU0 runs J0 (default 22,14.5), GPU1 runs J1 (default 7,11)
#   STAGE=rest:     GPU0 runs the GPU test suite (junit), GPU1 the journeys J1 and timing runs T1 (T1= for none)
#                   (defaults: every timing run, about 12 minutes: raise LIMIT, or spread them as below)
#   STAGE=one:      one GPU runs journeys J and timing runs T, one after the other (a short call; T= for none;
#                   defaults: J=11, T=b1_dense,b1_none,b1_11: the three runs of the batch-1 speed targets)
#   STAGE=one J= T=gen_9: the generate target alone (generate_9gib_over_dense_tokens_per_s: the recipe's model
#                   written as an export, `neutrain generate` of it under 9 GiB, then dense with no budget; ~3 minutes)
#   A 4-GPU call for the timing targets alone: STAGE=spread T_0=b1_dense,b1_none T_1=b1_11,b1_7 T_2=b1_5,b8_none
#   T_3=b8_11,b8_7,b8_5 (about 4 minutes on that GPU, 3 on the others).
#   STAGE=spread:   GPU k runs the GPU suite first if SUITE=k, then journeys J_k and timing runs T_k, every GPU
#                   at once, work in /dev/shm (a 4-GPU machine: J_0=22 J_1=14.5 J_2=11 J_3=7 in one call)
# With one GPU, STAGE's two lists run one after the other on it.
# Disk: a journey holds up to ~46 GiB (three 10 GiB checkpoints and a 15 GiB export) until it is cleaned:
# GPU1's work (the offloaded budgets) goes in /dev/shm, GPU0's on disk.
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 STAGE=journeys bash benchmarks/cards/gpu_cards.sh
set -u
cd "$(dirname "$0")/../.."
source benchmarks/require_commit.sh
OUT=${OUT:-/tmp/neutrain-cards-out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 DISABLE_TQDM=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
source benchmarks/install_carried_wheels.sh > /dev/null
source benchmarks/install_user_commands.sh
STAGE=${STAGE:-journeys}
LIMIT=${LIMIT:-540}  # the whole stage on one GPU, seconds
cards() {  # part budgets timing workdir
  timeout -k 5 "$LIMIT" python3 benchmarks/cards/cards.py --part "$1" --budgets "$2" --timing "$3" --work "$4" \
    > "$OUT/cards_$1.log" 2>&1
  rm -rf "$4"
}
suite() {
  timeout -k 5 "$LIMIT" python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml="$OUT/junit_gpu_h100.xml" tests \
    > "$OUT/gpu_suite.log" 2>&1
  tail -n 3 "$OUT/gpu_suite.log"
}
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
# GPU k of this script is the k-th GPU the caller made visible (not physical GPU k: a caller that gave this
# script GPU 3 alone must not get GPU 0), and its work folder carries that GPU's id, so two callers on two GPUs
# never share (nor delete) one folder.
IFS=, read -ra visible <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((ngpu - 1)))}"
if [ "$STAGE" = spread ]; then
  for k in $(seq 0 $((ngpu - 1))); do
    j="J_$k"; t="T_$k"
    if [ -z "${!j-}${!t-}" ] && [ "${SUITE-}" != "$k" ]; then continue; fi
    (
      export CUDA_VISIBLE_DEVICES=${visible[$k]}
      if [ "${SUITE-}" = "$k" ]; then suite; fi
      if [ -n "${!j-}${!t-}" ]; then cards "g$k" "${!j-}" "${!t-}" "/dev/shm/cards_gpu${visible[$k]}"; fi
    ) &
  done
  wait
  grep -h "^budget\|^b[0-9]\|^gen_" "$OUT"/cards_*.log
  echo "done in ${SECONDS}s"
  exit 0
fi
if [ "$STAGE" = one ]; then
  # WORK: another folder where two STAGE=one calls share a GPU (each its own OUT too).
  cards one "${J-11}" "${T-b1_dense,b1_none,b1_11}" "${WORK:-/dev/shm/cards_one_gpu${visible[0]}}"
  grep -h "^budget\|^b[0-9]\|^gen_" "$OUT"/cards_*.log
  echo "done in ${SECONDS}s"
  exit 0
fi
if [ "$STAGE" = journeys ]; then
  first() { cards j0 "${J0:-22,14.5}" "" "/tmp/cards_j0_gpu${visible[0]}"; }
  second() { cards j1 "${J1:-7,11}" "" "/dev/shm/cards_j1_gpu${visible[1]:-${visible[0]}}"; }
else
  first() { suite; }
  second() { cards t1 "${J1-}" "${T1-b1_dense,b1_none,b1_11,b1_7,b1_5,b8_none,b8_11,b8_7,b8_5}" "/dev/shm/cards_t1_gpu${visible[1]:-${visible[0]}}"; }
fi
if [ "$ngpu" -ge 2 ]; then
  ( export CUDA_VISIBLE_DEVICES=${visible[0]}; first ) &
  ( export CUDA_VISIBLE_DEVICES=${visible[1]}; second ) &
  wait
else
  first; second
fi
grep -h "^budget\|^b[0-9]\|^gen_" "$OUT"/cards_*.log
echo "done in ${SECONDS}s"
