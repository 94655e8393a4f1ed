#!/usr/bin/env bash
# The 70B memory gate (Llama-3-70B trains on one card), as a user runs it: the literal `accelerate launch recipes/llama3_70b_offload.yaml`
# on one H100 80GB (CUDA_VISIBLE_DEVICES picks it on a machine of several), STEPS steps with a save at the
# last, then a second launch that resumes from that checkpoint for one step more. Then
# benchmarks/offload_recipe.py reads both runs' metrics.jsonl and summary.json and nvidia-smi's samples
# (device memory in use) into $OUT/offload.json (merged into an offload.json of benchmarks/offload.py's
# parts from the same call, if $OUT holds one).
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 CUDA_VISIBLE_DEVICES=1 bash benchmarks/gpu_70b_recipe.sh
# STAGES=train,resume (default) or one of them, in two back-to-back device calls when one is too short
# (the machine keeps /tmp while it is warm). Disk: the compressed 70B checkpoint is ~89 GiB, so the first
# run writes to RUN_DIR on disk (128 GiB on a 2-GPU machine) and the resumed run's own final checkpoint
# goes to RESUME_DIR (default /dev/shm): two of them do not fit one disk of that machine.
set -u
cd "$(dirname "$0")/.."
source benchmarks/require_commit.sh
OUT=${OUT:-/tmp/neutrain-70b}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 DISABLE_TQDM=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
source benchmarks/install_carried_wheels.sh
RUN_DIR=${RUN_DIR:-/tmp/llama3_70b_offload}
RESUME_DIR=${RESUME_DIR:-/dev/shm/llama3_70b_offload_resumed}
STEPS=${STEPS:-5}
STAGES=${STAGES:-train,resume}
gpu=${CUDA_VISIBLE_DEVICES:-0}
free -g | head -2; df -h /tmp /dev/shm | tail -2
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -i "$gpu" -lms 1000 >> "$OUT/nvsmi_70b.csv" &
smi=$!
if [[ $STAGES == *train* ]]; then
  t0=$SECONDS
  accelerate launch recipes/llama3_70b_offload.yaml train.max_steps="$STEPS" train.save_steps="$STEPS" \
    train.output_dir="$RUN_DIR" > "$OUT/70b_train.log" 2>&1
  echo "70b train rc=$? ($((SECONDS - t0)) s)"; tail -n 25 "$OUT/70b_train.log"
  echo "train_s=$((SECONDS - t0))" >> "$OUT/70b_stages.txt"
fi
if [[ $STAGES == *resume* ]]; then
  t0=$SECONDS
  accelerate launch recipes/llama3_70b_offload.yaml train.max_steps="$((STEPS + 1))" train.save_steps="$((STEPS + 1))" \
    train.output_dir="$RESUME_DIR" train.resume_from_checkpoint="$RUN_DIR/checkpoint-$STEPS" > "$OUT/70b_resume.log" 2>&1
  echo "70b resume rc=$? ($((SECONDS - t0)) s)"; tail -n 25 "$OUT/70b_resume.log"
  echo "resume_s=$((SECONDS - t0))" >> "$OUT/70b_stages.txt"
fi
kill "$smi" 2>/dev/null
python3 benchmarks/offload_recipe.py --train "$RUN_DIR" --resume "$RESUME_DIR" --steps "$STEPS" \
  --nvsmi "$OUT/nvsmi_70b.csv" --stages "$OUT/70b_stages.txt"
echo "done in ${SECONDS}s"
