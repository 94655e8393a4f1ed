#!/usr/bin/env bash
# One device call: install the carried wheels the image lacks (install_carried_wheels.sh), then run the GPU-marked tests named in
# TESTS ("name=path[,path...] ...": one junit_<name>.xml per group into $OUT) and, if RECIPE_STEPS is
# set, the default recipe on the GPU for that many steps.
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 \
#   TESTS="launch=tests/integration/test_distributed_gpu.py" OUT=/tmp/out bash benchmarks/training/gpu_verify.sh
# Each junit file records NEUTRAIN_GIT_COMMIT and NEUTRAIN_GIT_DIRTY as <properties> (tests/conftest.py).
set -u
cd "$(dirname "$0")/../.."
source benchmarks/require_commit.sh
OUT=${OUT:-/tmp/neutrain-gpu-verify}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DISABLE_TQDM=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0
source benchmarks/install_carried_wheels.sh
python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))"
for spec in ${TESTS:-}; do
  name=${spec%%=*}
  IFS=, read -r -a paths <<< "${spec#*=}"
  timeout -k 5 "${TEST_LIMIT:-300}" python3 -m pytest -q "${paths[@]}" -p no:cacheprovider \
    --junitxml="$OUT/junit_$name.xml" > "$OUT/junit_$name.log" 2>&1
  echo "tests $name rc=$? (${SECONDS}s)"; tail -n 4 "$OUT/junit_$name.log"
done
if [ -n "${RECIPE_STEPS:-}" ]; then
  timeout -k 5 "${RECIPE_LIMIT:-240}" python3 -m neutrain recipes/default.yaml "train.max_steps=$RECIPE_STEPS" \
    "train.output_dir=/tmp/default-run" > "$OUT/default_recipe.log" 2>&1
  echo "default recipe rc=$? (${SECONDS}s)"; grep -A12 "run summary" "$OUT/default_recipe.log" || tail -n 30 "$OUT/default_recipe.log"
fi
echo "done in ${SECONDS}s"
