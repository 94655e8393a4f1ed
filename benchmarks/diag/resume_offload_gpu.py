"""Is a resume under weight offload bit-exact, and if not, do the decoded values differ or only their encoding?

The 8B recipe's shapes with two decoder layers (the embedding and lm_head keep their full 128256 x 4096),
trained 6 steps with saves at 4 and 6, then resumed from 4 to 6, with the weights offloaded and without.
For every tensor whose bytes differ between the two checkpoint-6, it decodes both and counts the values
that differ. Prints one table; writes ``$OUT/resume_offload.json``.

    python benchmarks/diag/resume_offload_gpu.py
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


def decoded_differences(a: Path, b: Path, names: list[str]) -> dict[str, dict]:
    """{weight: {"values_differing": n, "numel": N}} for compressed weights among ``names``."""
    import torch
    from safetensors import safe_open

    from neutrain.compress import CompressedTensor

    DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    weights = sorted({n.split("/", 1)[1].rpartition(".weight.")[0] + ".weight" for n in names if ".weight." in n})
    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb:
        for w in weights:
            ta = {k[len(w) + 1:]: fa.get_tensor(k) for k in fa.keys() if k.startswith(w + ".")}
            tb = {k[len(w) + 1:]: fb.get_tensor(k) for k in fb.keys() if k.startswith(w + ".")}
            da = CompressedTensor.from_state_dict(ta, name=w, device=DEVICE).decompress()
            db = CompressedTensor.from_state_dict(tb, name=w, device=DEVICE).decompress()
            differ = (da.view(torch.int16) != db.view(torch.int16))
            out[w] = {"values_differing": int(differ.sum()), "numel": da.numel(),
                      "rows_differing": int(differ.view(da.shape[0], -1).any(dim=1).sum()),
                      "stream_bytes": [int(ta["stream"].numel()), int(tb["stream"].numel())]}
    return out


def main() -> int:
    out = Path(os.environ.get("OUT", "/tmp/resume-offload-out"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/resume-offload")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "config.json").write_text(json.dumps(CONFIG))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from cards import checkpoint_tensors

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
