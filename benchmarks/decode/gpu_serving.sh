#!/usr/bin/env bash
# Serving (decode) on the GPU: the engine's GPU tests, its decode speed against the HBM roofline and a
# speculative round's cost, in ONE device call on one H100, < 5 minutes, from the repository root:
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 bash benchmarks/decode/gpu_serving.sh
# 1. the GPU-marked tests of tests/unit/speculative, tests/unit/eval and tests/kernels/test_gemv.py (the engine after its move to
#    neutrain/eval, fused projections, graph-replayed rounds): junit in $OUT (~1-2 min);
# 2. benchmarks/decode/engine_decode.py on Llama-3-8B shapes (random weights from a config, nothing downloads):
#    first the GEMV table (cuBLAS against the split-K Triton GEMV per decode shape, ~30 s), then
#    dense bf16 engine_graph (fused Q/K/V and gate/up), engine_graph_unfused and hf_generate, then NeuZip
#    lossless if the dense rows ended within ENGINE_BUDGET seconds; engine_decode.json into $OUT
#    (then added to benchmarks/decode/results.jsonl) (~2-3 min);
# 3. if the call is under ROUNDS_START seconds by then: benchmarks/decode/speculative_rounds.py (random weights:
#    a round's split, the device walk's graph time against the host walk), with what is left of ~290 s.
# A failing or timed-out part does not stop the next; each prints its tail and rc. PARTS (default
# tests,engine,rounds) picks parts: e.g. the NeuZip ratio in one call of its own:
#   PARTS=engine WEIGHTS=dense,neuzip-lossless ENGINE_BUDGET=200 ENGINE_LIMIT=280 bash benchmarks/decode/gpu_serving.sh
# Writes $OUT/junit_gpu_serving_<sha>.xml, engine_decode.json and speculative_rounds.json (also into
# benchmarks/<topic>/results.jsonl) and a log per part.
set -u
cd "$(dirname "$0")/../.."
source benchmarks/require_commit.sh
OUT=${OUT:-/tmp/neutrain-serving}
mkdir -p "$OUT"
export OUT PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 DISABLE_TQDM=1 TOKENIZERS_PARALLELISM=false
short=${NEUTRAIN_GIT_COMMIT:0:7}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"

PARTS=",${PARTS:-tests,engine,rounds},"
if [[ $PARTS == *,tests,* ]]; then
timeout -k 10 "${TEST_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/decode tests/unit/speculative tests/unit/eval tests/kernels/test_gemv.py \
  --junitxml="$OUT/junit_gpu_serving_$short.xml" -o junit_suite_name="gpu-serving@$NEUTRAIN_GIT_COMMIT" -rfEs \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? (${SECONDS}s)"
grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUT/gpu_tests.log" | tail -30
fi

if [[ $PARTS == *,engine,* ]]; then
timeout -k 10 "${ENGINE_LIMIT:-170}" python3 benchmarks/decode/engine_decode.py --weights "${WEIGHTS:-dense,neuzip-lossless}" \
  --budget-s "${ENGINE_BUDGET:-100}" --repeats "${REPEATS:-3}" --out-dir "$OUT" > "$OUT/engine_decode.log" 2>&1
echo "engine_decode rc=$? (${SECONDS}s)"
tail -n 25 "$OUT/engine_decode.log"
# Written straight to $OUT (a failed run leaves no stale copy of the committed record there), then into the table.
python3 benchmarks/records.py add "$OUT/engine_decode.json" 2>/dev/null || echo "no engine_decode.json written"
fi

if [[ $PARTS != *,rounds,* ]]; then
  :
elif [ "$SECONDS" -lt "${ROUNDS_START:-200}" ]; then
  timeout -k 5 $(( ${TOTAL_LIMIT:-290} - SECONDS )) python3 benchmarks/decode/speculative_rounds.py --out-dir "$OUT" \
    > "$OUT/speculative_rounds.log" 2>&1
  echo "speculative_rounds rc=$? (${SECONDS}s)"
  tail -n 16 "$OUT/speculative_rounds.log" | cut -c1-400
  python3 benchmarks/records.py add "$OUT/speculative_rounds.json" 2>/dev/null || echo "no speculative_rounds.json written"
else
  echo "speculative_rounds skipped: ${SECONDS}s spent"
fi
echo "done in ${SECONDS}s"
