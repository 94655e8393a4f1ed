"""Does a shipped recipe visibly learn within its steps? Its loss curve under a few optimizer settings.

A recipe that trains from random init (the 8B recipe is shape-only: `init: random`) must still show a user
the loss falling within its own steps. LOMO's update under per-tensor clipping is ``lr`` times a unit-norm
direction per matrix, so a rate that is small against the weights' bf16 spacing (about 0.4% of a weight)
moves nothing: the loss stays flat. This launches the recipe, as a user does (`accelerate launch`), once
per setting, several at once on one GPU (each process's peaks are its own; the device is shared), and
reports the mean loss of the first and last three steps and each run's peak reserved memory.

    python benchmarks/training/recipe_learning.py --recipe recipes/llama3_8b.yaml --steps 22 \
        --setting "train.learning_rate=1e-3" --setting "train.learning_rate=0.1"

Writes ``$OUT/recipe_learning.json`` and prints a table; the notes beside the recipe quote it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import read_run  # noqa: E402 (after the path is set)


def run_settings(recipe: str, settings: list[str], steps: int, work: Path, out: Path, limit: float,
                 cpu: bool = False) -> list[dict]:
    """Launch ``recipe`` once per setting (space-separated overrides), all at once; their records."""
    work.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, setting in enumerate(settings):
        run = work / f"run{i}"
        cmd = ["accelerate", "launch", *(["--cpu"] if cpu else []), recipe, *setting.split(),
               f"train.max_steps={steps}", "train.logging_steps=1", "train.save_steps=100000",
               "memory.device_budget_gib=none", "export.format=none", f"train.output_dir={run}",
               *(["train.use_cpu=true"] if cpu else [])]
        log = open(work / f"recipe_learning_{i}.log", "w")
        procs.append((setting, run, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT),
                      time.perf_counter()))
    records = []
    for setting, run, log, proc, t0 in procs:
        try:
            rc = proc.wait(timeout=max(1.0, limit - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = 124
        log.close()
        got = read_run(run) if (run / "metrics.jsonl").exists() else {"steps": [], "phases": [], "summary": {}}
        losses = [s["loss"] for s in got["steps"]]
        step_rec = next((p for p in got["phases"] if p["phase"] == "train_step"), {})
        records.append({"setting": setting, "rc": rc, "losses": losses,
                        "first3": round(statistics.mean(losses[:3]), 4) if len(losses) >= 3 else None,
                        "last3": round(statistics.mean(losses[-3:]), 4) if len(losses) >= 3 else None,
                        "train_step_peak_reserved_gib": step_rec.get("peak_reserved_gib")})
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/llama3_8b.yaml")
    ap.add_argument("--setting", action="append", required=True, help="overrides of one run, space-separated")
    ap.add_argument("--steps", type=int, default=22)
    ap.add_argument("--work", default="/tmp/neutrain-recipe-learning")
    ap.add_argument("--limit", type=float, default=400, help="seconds the runs may take together")
    ap.add_argument("--cpu", action="store_true", help="a flow check on the CPU (no measurement)")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/neutrain-recipe-learning-out"))
    out.mkdir(parents=True, exist_ok=True)
    records = run_settings(args.recipe, args.setting, args.steps, Path(args.work), out, args.limit, args.cpu)
    import torch

    result = {"recipe": args.recipe, "steps": args.steps, "device": torch.cuda.get_device_name(0)
              if torch.cuda.is_available() and not args.cpu else "cpu",
              "commit": os.environ.get("NEUTRAIN_GIT_COMMIT"), "runs": records,
              "sharing": f"{len(records)} runs at once on one device"}
    (out / "recipe_learning.json").write_text(json.dumps(result, indent=1))
    print(f"{'setting':<60}{'rc':>4}{'first3':>9}{'last3':>9}{'reserved':>10}")
    for r in records:
        print(f"{r['setting']:<60}{r['rc']:>4}{r['first3'] or float('nan'):>9.3f}{r['last3'] or float('nan'):>9.3f}"
              f"{r['train_step_peak_reserved_gib'] or float('nan'):>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
