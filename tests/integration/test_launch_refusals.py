"""A launch of several processes that neutrain refuses ends in its one line: no launcher traceback or report.

torch elastic's launcher (torchrun, ``accelerate launch``) takes any non-zero exit of a process for a crash,
and printed its traceback and a failure report under neutrain's line (:mod:`neutrain.compat.elastic`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port, launcher

REPO = Path(__file__).resolve().parents[2]

REFUSAL = ("neutrain: error: train.max_steps: 0 trains nothing; give a number of steps > 0, or -1 to train "
           "train.num_epochs epochs")


@pytest.mark.slow
def test_a_refused_torchrun_launch_of_two_processes_ends_in_one_line(tmp_path):
    import os

    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    res = subprocess.run([*launcher("torch.distributed.run"), "--nproc-per-node", "2", "--master-port", str(free_port()),
                          "-m", "neutrain", "recipes/default.yaml", f"train.output_dir={tmp_path / 'out'}",
                          "train.max_steps=0"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    both = res.stdout + res.stderr
    assert res.returncode != 0
    # Before: the line (from each process), then torch elastic's traceback and its "neutrain FAILED" report.
    assert "Traceback" not in both and "ChildFailedError" not in both and "FAILED" not in both, both[-4000:]
    assert [line for line in both.splitlines() if "neutrain: error:" in line] == [REFUSAL], both[-4000:]
