"""The cards benchmark's journey runs end to end on the CPU: the user's commands in order, each judged.

``benchmarks/cards/cards.py`` is the gate of the device budgets (train with saves, resume and export, generate under
the budget and without one). Its GPU calls are scarce, so its flow is checked here first with a tiny model
(``--smoke``): every command exits 0, the resumed checkpoint equals the uninterrupted one byte for byte, and the
two generates print the same tokens. A journey whose resume differs, or whose generate differs, is not ok.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _smoke(tmp_path, part: str, budgets: str, timing: str) -> tuple[dict, Path]:
    """``cards.py --smoke`` as the device runs it, in ``tmp_path``: the part's record and the work folder."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "NEUTRAIN_GIT_COMMIT": "0" * 40, "NEUTRAIN_GIT_DIRTY": "1",
           # the journey types `accelerate` and `neutrain` as a user does: this interpreter's own
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    res = subprocess.run([sys.executable, "benchmarks/cards/cards.py", "--smoke", "--part", part, "--budgets", budgets,
                          "--timing", timing, "--work", str(work)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads((out / f"cards_{part}.json").read_text()), work


def test_the_smoke_journey_runs_every_command_and_judges_it(tmp_path):
    record, work = _smoke(tmp_path, "smoke", "7", "")
    (journey,) = record["budgets"]
    assert {k: c["rc"] for k, c in journey["commands"].items()} == {
        "train": 0, "resume_export": 0, "generate": 0, "generate_dense": 0}, journey["commands"]
    assert journey["resume_bit_identical"] is True and journey["resume_tensors_compared"] > 0
    assert journey["generate_equals_dense"] is True and journey["generate_text"]
    assert journey["ok"] is True
    assert not work.exists() or not any(work.iterdir())  # each journey cleans up after itself


def test_the_smoke_generate_timing_writes_the_generate_target(tmp_path):
    """``--timing gen_9``: the recipe's model as an export, ``neutrain generate`` of it under the budget and with none
    (both on the CPU here), their rates, and the target from them in the part's own record."""
    record, work = _smoke(tmp_path, "gen", "", "gen_9")
    timing = record["timing"]["gen_9"]
    assert {k: c["rc"] for k, c in timing["commands"].items()} == {"export": 0, "budget": 0, "dense": 0}, timing
    assert timing["budget"]["tokens_per_s"] > 0 and timing["dense"]["tokens_per_s"] > 0 and timing["same_text"] is True
    target = record["targets"]["generate_9gib_over_dense_tokens_per_s"]
    assert target["goal"] == ">= 0.90" and target["met"] == (target["value"] >= 0.90)
    assert target["value"] == round(timing["budget"]["tokens_per_s"] / timing["dense"]["tokens_per_s"], 3)
    assert not work.exists() or not any(work.iterdir())  # the export is removed after the timing run
