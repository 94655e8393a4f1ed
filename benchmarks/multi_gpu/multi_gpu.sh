#!/usr/bin/env bash
# One call on one 4-GPU machine: install the carried wheels, run the GPU distributed tests
# (junit XML), then benchmark fused LOMO on the Llama-3-8B architecture for 1, 2 and 4 GPUs
# in every mode. Each run writes its JSON into $OUT as soon as it ends; a failing or slow
# mode is logged and skipped, the others go on. A time budget (BUDGET seconds, default 530)
# keeps the whole call under the device's 10-minute limit.
#
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 OUT=/tmp/out bash benchmarks/multi_gpu/multi_gpu.sh
set -u
cd "$(dirname "$0")/../.."
# The runs' records, junit and logs come back in $OUT; `python benchmarks/records.py add` folds them into the tables.
OUT=${OUT:-/tmp/neutrain-multi-gpu}
mkdir -p "$OUT"
BUDGET=${BUDGET:-530}
export PYTHONUNBUFFERED=1 DISABLE_TQDM=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0          # NVLink multicast stays off on the lent machines
source benchmarks/require_commit.sh   # the commit (and dirty flag) every JSON and junit file records

# --- carried wheels, only for what the image lacks (never shadow its own packages) ---------------
source benchmarks/install_carried_wheels.sh
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1

left() { echo $(( BUDGET - SECONDS )); }

# --- GPU tests ------------------------------------------------------------------------------------
# One pytest per case (its own junit file), so a hang costs one case, not the others' reports.
for case in ${TEST_CASES:-fsdp2-adalomo replicated-adalomo replicated-lomo-neuzip zero3-lomo zero3-lomo-stale}; do
  timeout -k 5 75 python3 -m pytest -q -m gpu "tests/unit/distributed/test_gpu.py::test_two_gpus_match_one[$case]" \
    --junitxml="$OUT/junit_multi_gpu_$case.xml" > "$OUT/junit_multi_gpu_$case.log" 2>&1
  echo "test $case rc=$? ($(left)s left)"; tail -n 3 "$OUT/junit_multi_gpu_$case.log"
done

# --- benchmark: 1 GPU, then 2 and 4 GPUs per mode ----------------------------------------------------
NGPU=${NGPU:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
BENCH_ARGS=${BENCH_ARGS:-}   # CPU dry run: NGPU=2 BENCH_ARGS=--tiny bash benchmarks/multi_gpu/multi_gpu.sh
port=29650
bench() {  # bench <gpus> <mode> [extra benchmark arguments]
  local n=$1 mode=$2 limit=110 rest tag=${3:+_$(echo "$3" | tr -dc 'a-z0-9')}
  rest=$(left)
  if [ "$n" -gt "$NGPU" ]; then echo "skip $mode x$n: $NGPU GPUs"; return; fi
  if [ "$rest" -lt 45 ]; then echo "skip $mode x$n: time budget spent"; return; fi
  [ "$limit" -gt $(( rest - 15 )) ] && limit=$(( rest - 15 ))
  port=$((port + 1))
  timeout -k 5 "$limit" python3 -m torch.distributed.run --nproc_per_node "$n" --master_port "$port" \
    benchmarks/multi_gpu/multi_gpu.py --mode "$mode" --results-dir "$OUT" $BENCH_ARGS ${3:-} > "$OUT/multi_gpu_${mode}_${n}gpu$tag.log" 2>&1
  echo "bench $mode x$n ${3:-} rc=$? ($(left)s left)"
  grep -E '"(tokens_per_s_per_gpu|peak_allocated_gib_per_gpu|step_time_s)"' "$OUT/multi_gpu_${mode}_${n}gpu$tag.log" \
    || tail -n 8 "$OUT/multi_gpu_${mode}_${n}gpu$tag.log"
}
bench 1 single
for mode in ${BENCH_MODES:-fsdp2 replicated zero3}; do
  bench 2 "$mode"
  bench 4 "$mode"
done
# Ablation: ZeRO-3 with each reduce-scatter finished before backward goes on (outside the summary).
[ "${ZERO3_ABLATION:-1}" = 1 ] && bench 4 zero3 "--max-inflight 0"
# --- the launch/ configs through accelerate launch -m neutrain on 2 GPUs, if time is left -----------
if [ "${LAUNCH_TESTS:-1}" = 1 ] && [ "$(left)" -gt 100 ]; then
  timeout $(( $(left) - 15 )) python3 -m pytest -q -m gpu tests/integration/test_distributed_gpu.py \
    --junitxml="$OUT/junit_multi_gpu_launch.xml" > "$OUT/junit_multi_gpu_launch.log" 2>&1
  echo "launch tests rc=$? ($(left)s left)"; tail -n 6 "$OUT/junit_multi_gpu_launch.log"
else
  echo "skip launch tests (LAUNCH_TESTS=0, or the time budget is spent)"
fi
python3 benchmarks/multi_gpu/multi_gpu.py --summarize --write --results-dir "$OUT" $BENCH_ARGS 2>&1 | grep -v WARNING | tail -n 12
echo "done in ${SECONDS}s"
