"""A signal to a launcher, or to one of its processes, stops the whole run at one step boundary with a save.

Real launches (``accelerate launch`` with one CPU process, ``torchrun`` with two): SIGTERM to the launcher ended
only the launcher (the trainer was orphaned, kept the run's lock, trained to the end and never saved), and a
signal to one of two processes must stop both at the same step. The single-process signal handling is
``tests/faults/test_signals.py``.
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
from tests.helpers import free_port, write_recipe


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


def _child_with_rank(parent: int, rank: int) -> int | None:
    """The pid of ``parent``'s child process launched with ``LOCAL_RANK=rank`` (torchrun's workers), if any yet."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent and f"LOCAL_RANK={rank}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
        except (OSError, IndexError, ValueError):
            continue
    return None


def _two_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds torchrun's workers through /proc")
@pytest.mark.parametrize("use_cpu", [True, pytest.param(False, id="nccl", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs (NCCL, the flag over gloo)")])])
def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step_with_one_checkpoint(tmp_path, use_cpu):
    train = {**LONG, "optimizer": "adalomo", "learning_rate": 1e-2, "micro_batch_size": 2, "use_cpu": use_cpu}
    recipe = write_recipe(tmp_path, train=train, **QUIET)
    env = {**_subprocess_env(), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(free_port()), "-m", "neutrain", "train", str(recipe)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("step 3/"):
                break
        rank1 = _child_with_rank(proc.pid, 1)
        assert rank1 is not None, "torchrun's rank 1 not found"
        os.kill(rank1, signal.SIGTERM)  # as a scheduler signalling one node would
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:  # a hang (the processes disagreeing on the step): end torchrun and its workers
            os.killpg(proc.pid, signal.SIGKILL)
    stops = sorted(line for line in stderr.splitlines() if "neutrain: error: stopped by SIGTERM at step " in line)
    assert len(stops) == 2, stderr[-3000:]
    steps = {int(line.split("at step ")[1].split(":")[0]) for line in stops}
    assert len(steps) == 1, stops  # both processes saved and stopped at the same step boundary
    step = steps.pop()
    verify_checkpoint(tmp_path / "out" / f"checkpoint-{step}")
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == [f"checkpoint-{step}"]
