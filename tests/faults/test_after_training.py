"""A run stopped in a phase after training (evaluation, export, the summary) finishes those phases when relaunched.

A run stopped during held-out evaluation or export relaunched to "run already finished", exit 0, and
never produced its export, summary or evaluation; SIGTERM in those phases killed the process at once,
without a word. A real run is held inside its export and sent SIGTERM, as a scheduler would; the relaunch
runs in-process.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from neutrain.cli import main as neutrain
from neutrain.storage.manifest import verify_checkpoint
from tests.faults.pause_at import signal_and_collect
from tests.faults.test_locks import _wait_for_pause
from tests.faults.test_run_directory import REPO, _env
from tests.helpers import write_recipe


def test_sigterm_during_the_export_stops_in_one_line_and_a_relaunch_finishes_every_phase(tmp_path, capsys):
    recipe = write_recipe(tmp_path, train={"max_steps": 2, "save_steps": 2}, eval={"perplexity": True},
                          export={"format": "hf"})
    out, gate = tmp_path / "out", tmp_path / "gate"
    gate.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "tests.faults.pause_at", "neutrain.export:export_model", str(gate),
                             "train", str(recipe)], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for_pause(proc, gate)  # training and the held-out evaluation are done; the export is under way
    _, err = signal_and_collect(proc, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("neutrain:") or "Traceback" in line]
    assert len(lines) == 1 and lines[0].startswith("neutrain: error: stopped by SIGTERM during export: hf: "), err[-3000:]
    assert f"training is saved in {out / 'checkpoint-2'}" in lines[0]
    assert not (out / "export").exists() and not (out / "summary.json").exists()
    assert (out / ".neutrain.lock").read_text() == ""  # released on the way out

    capsys.readouterr()
    assert neutrain(["train", str(recipe), "train.resume_from_checkpoint=true"]) == 0
    said = capsys.readouterr().out
    assert "the phases after training did not complete" in said and "run already finished" not in said
    verify_checkpoint(out / "export")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["export_dir"] == str(out / "export")
    assert summary["heldout_perplexity"] > 0 and summary["loss_last"] > 0
    assert not (out / "checkpoint-3").exists()  # nothing trained again
    # Now finished: a relaunch writes nothing.
    assert neutrain(["train", str(recipe), "train.resume_from_checkpoint=true"]) == 0
    assert "run already finished" in capsys.readouterr().out
