"""Is a resume under weight offload bit-exact, and if not, do the decoded values differ or only their encoding?

The 8B recipe's shapes with two decoder layers (the embedding and lm_head keep their full 128256 x 4096),
trained 6 steps with saves at 4 and 6, then resumed from 4 to 6, with the weights offloaded and without.
For every tensor whose bytes differ between the two checkpoint-6, it decodes both and counts the values
that differ. Prints one table; writes ``$OUT/resume_offload.json``.

    python benchmarks/offload/resume_offload_gpu.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CONFIG = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
          "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
          "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def launch(args: list[str], log: Path) -> int:
    with open(log, "w") as fh:
        return subprocess.run(["accelerate", "launch", "recipes/llama3_8b.yaml", *args], stdout=fh,
                              stderr=subprocess.STDOUT, cwd=ROOT, timeout=300).returncode


def main() -> int:
    out = Path(os.environ.get("OUT", "/tmp/resume-offload-out"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/resume-offload")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "config.json").write_text(json.dumps(CONFIG))
    from benchmarks.training._checkpoints import checkpoint_tensors, decoded_differences

    results = {}
    for offload in (True, False):
        run = work / f"run_{offload}"
        common = [f"model.config={work / 'config.json'}", "memory.device_budget_gib=none",
                  f"memory.offload_weights={str(offload).lower()}", f"memory.offload_activations={str(offload).lower()}",
                  "memory.stochastic_rounding=false", "train.max_steps=6", "train.save_steps=4",
                  "train.save_total_limit=3", f"train.output_dir={run}", "export.format=none"]
        rc1 = launch(common, work / f"resume_offload_{offload}_train.log")
        reference = work / f"reference_{offload}"
        if rc1 == 0:
            (run / "checkpoint-6").rename(reference)
        rc2 = launch([*common, f"train.resume_from_checkpoint={run}/checkpoint-4"], work / f"resume_offload_{offload}_resume.log")
        rec = {"rc": [rc1, rc2]}
        if rc1 == 0 and rc2 == 0:
            a, b = checkpoint_tensors(reference), checkpoint_tensors(run / "checkpoint-6")
            differing = sorted(k for k in a if not k.endswith(".name") and a[k] != b.get(k))
            rec.update(compared=len(a), differing=differing,
                       decoded=decoded_differences(reference, run / "checkpoint-6", differing))
        results[f"offload={offload}"] = rec
        print(f"offload={offload}: rc {rec['rc']}, {len(rec.get('differing', []))} of {rec.get('compared')} tensors differ",
              flush=True)
        for w, d in rec.get("decoded", {}).items():
            print(f"  {w}: {d}", flush=True)
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(reference, ignore_errors=True)
    (out / "resume_offload.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
