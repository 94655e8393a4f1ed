"""A power cut never leaves a run without a usable checkpoint, nor its export half-written.

Only ``model.safetensors`` and the manifest were synced before a checkpoint was renamed into place,
and the previous checkpoint was deleted right after: with ``save_total_limit: 1`` a power cut left a
``checkpoint-N`` whose optimizer, scheduler, RNG and tokenizer files read back empty, and no other.
A real run is killed (SIGKILL) once its export is written, and the power cut is emulated by putting
every file back to what its last fsync made durable (:mod:`tests.faults.power_cut`).
"""

from __future__ import annotations

import subprocess
import sys

from neutrain.cli import main as neutrain
from neutrain.storage.manifest import verify_checkpoint
from neutrain.trainer.callbacks import read_metrics
from tests.faults.power_cut import drop_unsynced
from tests.faults.test_run_directory import REPO, _env
from tests.helpers import write_recipe


def test_a_power_cut_after_a_save_and_an_export_leaves_both_whole_and_the_run_resumes(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 4, "save_steps": 2, "save_total_limit": 1},
                          eval={"perplexity": False}, export={"format": "hf"})
    out, journal = tmp_path / "out", tmp_path / "journal"
    proc = subprocess.run([sys.executable, "-m", "tests.faults.power_cut", str(journal), "neutrain.export:export_model",
                           "train", str(recipe)], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]  # killed where it was meant to be
    lost = drop_unsynced(out, journal)
    # checkpoint-2 was rotated away once checkpoint-4 was in place: checkpoint-4 must hold every byte.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]
    assert not [f for f in lost if f.startswith(("checkpoint-4/", "export/"))], lost
    verify_checkpoint(out / "checkpoint-4")
    verify_checkpoint(out / "export")
    assert neutrain(["train", str(recipe), "train.resume_from_checkpoint=true", "train.max_steps=6"]) == 0
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6], steps
