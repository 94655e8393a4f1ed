#!/usr/bin/env bash
# The Llama-3-70B whole run at a 24 GB card's budget, as a user runs it, on one GPU of a 2-GPU H200 machine
# (CUDA_VISIBLE_DEVICES picks it; 128 GiB of disk, 256 GiB of memory):
#   train     accelerate launch recipes/llama3_70b_offload.yaml memory.device_budget_gib=22 train.max_steps=4
#             train.save_steps=4 (the checkpoint to disk)
#   resume    the same to max_steps=5 from checkpoint-4 (saved to /dev/shm)
#   straight  the uninterrupted 5-step run (saved to disk), then its checkpoint-5 and the resumed one compared by
#             their manifests' per-tensor sha256 (a stage of its own, `compare`)
#   export    neutrain export <resumed checkpoint-5> --format neuzip (to disk); --format hf only where the disk
#             holds the dense bf16 size, else one line says why not
#   generate  neutrain generate <export> --device-budget-gib 22, and without a budget: 16 greedy tokens each
# benchmarks/offload_recipe.py --whole-run reads the runs' metrics and summaries, the commands' logs, the
# manifests' comparison, the texts and this script's samples (device memory in use from nvidia-smi; host memory
# used, and the largest peak resident size of neutrain's processes, from /proc) into $OUT/offload.json as
# `70b_recipe_22gib`, with the target card_24gb_70b_whole_run_ok (every command exits 0, the checkpoints match,
# the texts match).
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 CUDA_VISIBLE_DEVICES=0 bash benchmarks/gpu_70b_recipe.sh
#
# Time plan (30 minutes of device time, at most 10 a call): STAGES picks the stages of one call; the machine
# keeps /tmp and /dev/shm while it is warm, and STATE (on /tmp) keeps the stage times, logs and samples, so the
# last call's record has them all. Expected seconds (a 70B step is ~26 s; the 89 GiB checkpoint is written and
# hashed in one pass and read in one pass per check, benchmarks/notes_offload.md):
#   call 1  STAGES=train               build ~150 + 4 steps ~105 + save ~75            ~330
#   call 2  STAGES=resume              check ~50 + build/load ~150 + 1 step + save ~60  ~290
#   call 3  STAGES=straight,compare    build ~150 + 5 steps ~130 + save ~75 + compare  ~370
#   call 4  STAGES=export              check ~50 + load ~150 + write ~75                ~280
#   call 5  STAGES=generate            two loads of the export ~2 x 150 + 2 x 16 tokens  ~380
#   total about 1,650 s (27.5 minutes) beside the machine's start; each call is under 600 s.
# Disk: checkpoint-4 (89 GiB) fills most of the 128 GiB disk, so `straight` first records its manifest and
# deletes it (resumed from already); `compare` deletes the straight run's checkpoint once compared; the export
# then has the disk. The resumed checkpoint lies in /dev/shm (89 GiB beside the run's ~100 GiB of host memory).
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
STRAIGHT_DIR=${STRAIGHT_DIR:-/tmp/llama3_70b_offload_straight}
EXPORT_DIR=${EXPORT_DIR:-/tmp/llama3_70b_export}
HF_DIR=${HF_DIR:-/tmp/llama3_70b_export_hf}
STEPS=${STEPS:-4}
BUDGET=${BUDGET:-22}
NEW_TOKENS=${NEW_TOKENS:-16}
PROMPT=${PROMPT:-"def fibonacci(n):"}
STAGES=${STAGES:-train,resume,straight,compare,export,generate}
gpu=${CUDA_VISIBLE_DEVICES:-0}
RESUMED="$RESUME_DIR/checkpoint-$((STEPS + 1))"
echo "memory.device_budget_gib=$BUDGET on $(nvidia-smi --query-gpu=name --format=csv,noheader -i "$gpu")"
free -g | head -2; df -h /tmp /dev/shm | tail -2

# One sample every 2 s: the stage, the time, device MiB in use (NVML), host bytes used, and the largest VmHWM
# (KiB) among neutrain's processes (the trainer is accelerate's child; pinned layers count in its resident size).
echo idle > "$STATE/current_stage"
(
  while :; do
    dev=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i "$gpu" 2>/dev/null | head -1)
    host=$(free -b | awk '/^Mem:/ {print $3}')
    hwm=0
    for pid in $(pgrep -f "neutrain|accelerate" 2>/dev/null); do
      kib=$(awk '/^VmHWM:/ {print $2}' "/proc/$pid/status" 2>/dev/null)
      [ -n "$kib" ] && [ "$kib" -gt "$hwm" ] && hwm=$kib
    done
    echo "$(cat "$STATE/current_stage"),$(date +%s),${dev:-},${host:-},$hwm" >> "$STATE/samples.csv"
    sleep 2
  done
) &
sampler=$!
stage_begin() { echo "$1" > "$STATE/current_stage"; t0=$SECONDS; }
stage_end() {  # name rc: seconds and exit code into STATE; the log (written straight into $OUT, so a call cut by
  # its limit keeps it) copied into STATE for the record of a later call
  echo "$1_s=$((SECONDS - t0))" >> "$STATE/70b_stages.txt"; echo "$1_rc=$2" >> "$STATE/70b_stages.txt"
  echo "70b $1 rc=$2 ($((SECONDS - t0)) s)"; [ -f "$OUT/70b_$1.log" ] && tail -n 12 "$OUT/70b_$1.log"
  cp "$OUT/70b_$1.log" "$STATE/" 2>/dev/null; cp "$STATE/70b_stages.txt" "$OUT/"
  echo idle > "$STATE/current_stage"
}
launch() {  # output_dir max_steps [key=value ...]: the literal recipe at the budget
  local dir=$1 steps=$2; shift 2
  accelerate launch recipes/llama3_70b_offload.yaml memory.device_budget_gib="$BUDGET" train.max_steps="$steps" \
    train.save_steps="$steps" train.output_dir="$dir" "$@"
}
free_gib() { echo $(( $(df --output=avail -k "$1" | tail -1) / 1048576 )); }

if [[ $STAGES == *train* ]]; then
  stage_begin train
  launch "$RUN_DIR" "$STEPS" > "$OUT/70b_train.log" 2>&1
  stage_end train $?
fi
if [[ $STAGES == *resume* ]]; then
  stage_begin resume
  launch "$RESUME_DIR" "$((STEPS + 1))" train.resume_from_checkpoint="$RUN_DIR/checkpoint-$STEPS" > "$OUT/70b_resume.log" 2>&1
  stage_end resume $?
fi
if [[ $STAGES == *straight* ]]; then
  first="$RUN_DIR/checkpoint-$STEPS"
  if [ -d "$first" ]; then  # resumed from already: its record stays, its bytes make room for the straight run
    cp "$first/neutrain_manifest.json" "$STATE/checkpoint-$STEPS.manifest.json" 2>/dev/null
    python3 benchmarks/offload_recipe.py --describe "$first" > "$STATE/70b_checkpoint.json"
    echo "straight: deleting $first ($(free_gib /tmp) GiB free) to make room"; rm -rf "$first"
  fi
  stage_begin straight
  launch "$STRAIGHT_DIR" "$((STEPS + 1))" > "$OUT/70b_straight.log" 2>&1
  stage_end straight $?
fi
if [[ $STAGES == *compare* ]]; then
  stage_begin compare
  straight="$STRAIGHT_DIR/checkpoint-$((STEPS + 1))"
  python3 benchmarks/offload_recipe.py --compare-manifests "$RESUMED/neutrain_manifest.json" \
    "$straight/neutrain_manifest.json" > "$STATE/manifests.json" 2> "$OUT/70b_compare.log"
  rc=$?; cat "$STATE/manifests.json"
  [ -f "$straight/neutrain_manifest.json" ] && cp "$straight/neutrain_manifest.json" "$STATE/straight.manifest.json"
  rm -rf "$straight"  # compared and recorded: the export needs the disk
  stage_end compare $rc
fi
if [[ $STAGES == *export* ]]; then
  stage_begin export
  neutrain export "$RESUMED" --format neuzip --output "$EXPORT_DIR" > "$OUT/70b_export.log" 2>&1
  stage_end export $?
  need=$(python3 benchmarks/offload_recipe.py --bf16-gib "$RESUMED/config.json" 2>/dev/null || echo 0)
  have=$(free_gib "$(dirname "$HF_DIR")")
  if python3 -c "import sys; sys.exit(0 if float('$need') > 0 and $have > float('$need') + 2 else 1)"; then
    stage_begin export_hf
    neutrain export "$RESUMED" --format hf --output "$HF_DIR" > "$OUT/70b_export_hf.log" 2>&1
    stage_end export_hf $?
  else
    echo "not run: disk holds ${have} GiB, needs ${need} GiB" | tee "$STATE/export_hf.txt"
  fi
fi
if [[ $STAGES == *generate* ]]; then
  for kind in budget unbounded; do
    [ $kind = budget ] && limit=(--device-budget-gib "$BUDGET") || limit=()
    stage_begin generate_$kind
    neutrain generate "$EXPORT_DIR" "${limit[@]}" --prompt "$PROMPT" --raw --max-new-tokens "$NEW_TOKENS" \
      > "$STATE/generate_$kind.txt" 2> "$OUT/70b_generate_$kind.log"
    rc=$?; echo "text ($kind): $(cat "$STATE/generate_$kind.txt")"
    stage_end generate_$kind $rc
  done
fi
kill "$sampler" 2>/dev/null
python3 benchmarks/offload_recipe.py --whole-run "$STATE" --train "$RUN_DIR" --resume "$RESUME_DIR" \
  --straight "$STRAIGHT_DIR" --budget "$BUDGET" --steps "$STEPS" --export "$EXPORT_DIR"
echo "done in ${SECONDS}s"
