#!/usr/bin/env bash
# The 70B gate (Llama-3-70B trains, saves, resumes and exports on one card), as a user runs it: the literal
# `accelerate launch recipes/llama3_70b_offload.yaml` on one H100 80GB (CUDA_VISIBLE_DEVICES picks it on a
# machine of several), STEPS steps with a save at the last; a second launch that resumes from that
# checkpoint for one step more and saves; then `neutrain export <that checkpoint> --format neuzip`.
# benchmarks/offload_recipe.py reads the runs' metrics.jsonl and summary.json, the export and nvidia-smi's
# samples (device memory in use) into $OUT/offload.json (merged into benchmarks/offload.py's parts if $OUT
# holds one).
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 CUDA_VISIBLE_DEVICES=1 bash benchmarks/gpu_70b_recipe.sh
# STAGES=train,resume,export (default) or a part of them, in back-to-back device calls when one is too short:
# the machine keeps /tmp and /dev/shm while it is warm, and the stage times and nvidia-smi samples are kept
# in STATE (on /tmp) so the last call's record has them all. About 5 minutes for train, 7 for resume+export.
# Disk and host memory: the compressed 70B checkpoint is ~89 GiB and the run pins ~87 GiB of layers. The
# first run saves to RUN_DIR on disk; the resumed run saves to RESUME_DIR in /dev/shm; the export goes to
# disk. On a 128 GiB disk (2-GPU machine) the export stage first deletes the first run's checkpoint (this
# script's own scratch, already resumed from and recorded); a 4-GPU machine's 235 GiB disk holds both.
set -u
cd "$(dirname "$0")/.."
source benchmarks/require_commit.sh
OUT=${OUT:-/tmp/neutrain-70b}
STATE=${STATE:-/tmp/neutrain-70b-state}
mkdir -p "$OUT" "$STATE"
export OUT PYTHONUNBUFFERED=1 DISABLE_TQDM=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
source benchmarks/install_carried_wheels.sh > /dev/null
source benchmarks/install_user_commands.sh
RUN_DIR=${RUN_DIR:-/tmp/llama3_70b_offload}
RESUME_DIR=${RESUME_DIR:-/dev/shm/llama3_70b_offload_resumed}
EXPORT_DIR=${EXPORT_DIR:-/tmp/llama3_70b_export}
STEPS=${STEPS:-4}
STAGES=${STAGES:-train,resume,export}
gpu=${CUDA_VISIBLE_DEVICES:-0}
# The gate is one H100 80GB. On a larger card the run gets the budget `auto` gives on an H100 (78 GiB): on an
# H200 without it, the fit kept 77 of 80 layers on the card (120.5 GiB reserved), which is not the H100's run.
BUDGET=${BUDGET:-$(nvidia-smi --query-gpu=name --format=csv,noheader -i "$gpu" | grep -q "H100" && echo auto || echo 78)}
echo "memory.device_budget_gib=$BUDGET on $(nvidia-smi --query-gpu=name --format=csv,noheader -i "$gpu")"
free -g | head -2; df -h /tmp /dev/shm | tail -2
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -i "$gpu" -lms 1000 >> "$STATE/nvsmi_70b.csv" &
smi=$!
stage() {  # name seconds rc; each command logs straight into $OUT (a call cut by its limit keeps it), and STATE
  # keeps a copy for the record of a later call
  echo "$1_s=$2" >> "$STATE/70b_stages.txt"; echo "$1_rc=$3" >> "$STATE/70b_stages.txt"
  cp "$OUT/70b_$1.log" "$STATE/" 2>/dev/null; cp "$STATE/70b_stages.txt" "$OUT/"
}
if [[ $STAGES == *train* ]]; then
  t0=$SECONDS
  accelerate launch recipes/llama3_70b_offload.yaml train.max_steps="$STEPS" train.save_steps="$STEPS" \
    memory.device_budget_gib="$BUDGET" train.output_dir="$RUN_DIR" > "$OUT/70b_train.log" 2>&1
  rc=$?; echo "70b train rc=$rc ($((SECONDS - t0)) s)"; tail -n 25 "$OUT/70b_train.log"
  stage train $((SECONDS - t0)) $rc
fi
if [[ $STAGES == *resume* ]]; then
  t0=$SECONDS
  accelerate launch recipes/llama3_70b_offload.yaml train.max_steps="$((STEPS + 1))" train.save_steps="$((STEPS + 1))" \
    memory.device_budget_gib="$BUDGET" train.output_dir="$RESUME_DIR" train.resume_from_checkpoint="$RUN_DIR/checkpoint-$STEPS" \
    > "$OUT/70b_resume.log" 2>&1
  rc=$?; echo "70b resume rc=$rc ($((SECONDS - t0)) s)"; tail -n 25 "$OUT/70b_resume.log"
  stage resume $((SECONDS - t0)) $rc
fi
if [[ $STAGES == *export* ]]; then
  resumed="$RESUME_DIR/checkpoint-$((STEPS + 1))"
  if [ -d "$resumed" ] && [ -d "$RUN_DIR/checkpoint-$STEPS" ]; then
    python3 benchmarks/offload_recipe.py --describe "$RUN_DIR/checkpoint-$STEPS" > "$STATE/70b_checkpoint.json"
    mkdir -p "$(dirname "$EXPORT_DIR")"
    free_gib=$(( $(df --output=avail -k "$(dirname "$EXPORT_DIR")" | tail -1) / 1048576 ))
    if [ "$free_gib" -lt 95 ]; then  # a 128 GiB disk: the first run's checkpoint (recorded above) makes room
      echo "export: ${free_gib} GiB free on disk: deleting $RUN_DIR/checkpoint-$STEPS (resumed from, recorded)"
      rm -rf "$RUN_DIR/checkpoint-$STEPS"
    fi
  fi
  t0=$SECONDS
  neutrain export "$resumed" --format neuzip --output "$EXPORT_DIR" > "$OUT/70b_export.log" 2>&1
  rc=$?; echo "70b export rc=$rc ($((SECONDS - t0)) s)"; tail -n 8 "$OUT/70b_export.log"
  stage export $((SECONDS - t0)) $rc
fi
kill "$smi" 2>/dev/null
python3 benchmarks/offload_recipe.py --train "$RUN_DIR" --resume "$RESUME_DIR" --steps "$STEPS" \
  --nvsmi "$STATE/nvsmi_70b.csv" --stages "$STATE/70b_stages.txt" --checkpoint-record "$STATE/70b_checkpoint.json" \
  --export "$EXPORT_DIR"
echo "done in ${SECONDS}s"
