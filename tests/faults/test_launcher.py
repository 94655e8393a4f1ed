"""A scheduler's SIGTERM to ``accelerate launch`` reaches the trainer it started, which saves and stops.

SIGTERM to the launcher ended only the launcher: the trainer was orphaned, kept the run's lock, trained to
the end and never saved at the signal. A real ``accelerate launch`` (one CPU process) is started, and only
the launcher is signalled, as a scheduler preempting the job would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neutrain.storage.manifest import verify_checkpoint
from neutrain.trainer.callbacks import read_metrics
from tests.faults.test_run_lifecycle import QUIET, _subprocess_env
from tests.faults.test_signals import LONG
from tests.helpers import write_recipe


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
def test_sigterm_to_accelerate_launch_reaches_the_trainer_which_saves_and_releases_the_run(tmp_path):
    recipe = write_recipe(tmp_path, train=LONG, **QUIET)
    out = tmp_path / "out"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "neutrain", "train", str(recipe)],
        env={**_subprocess_env(), "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        for line in launcher.stdout:  # the trainer's per-step lines (it shares the launcher's pipes)
            if line.startswith("step 3/"):
                break
        trainers = _children(launcher.pid)
        assert len(trainers) == 1, trainers
        launcher.send_signal(signal.SIGTERM)  # the launcher only, not its process group
        _, err = launcher.communicate(timeout=180)  # EOF once the trainer, which holds the pipes too, has ended
        deadline = time.monotonic() + 60
        while Path(f"/proc/{trainers[0]}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        try:  # whatever is left of the launch (an orphaned trainer still training, when the test fails)
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    stops = [line for line in err.splitlines() if line.startswith("neutrain: error: stopped by SIGTERM at step ")]
    assert len(stops) == 1, err[-3000:]
    step = int(stops[0].split("at step ")[1].split(":")[0])
    assert 3 <= step < LONG["max_steps"]
    verify_checkpoint(out / f"checkpoint-{step}")
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r][-1] == step
    assert (out / ".neutrain.lock").read_text() == ""  # the trainer released the run on its way out
