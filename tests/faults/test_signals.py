"""SIGTERM and SIGINT during training save a checkpoint at the next step boundary, then exit non-zero in one line.

Why: schedulers send SIGTERM before they kill a job, and SIGTERM used to end the run
at once, saving nothing since the last ``save_steps`` checkpoint. The SIGTERM test runs a real
``neutrain train`` process and signals it as a scheduler would; the SIGINT ones run in-process (a
training step sends the signal to its own process), which is cheaper and hits the same handler.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neutrain.cli import main as neutrain
from neutrain.storage.manifest import verify_checkpoint
from neutrain.trainer.callbacks import read_metrics
from tests.faults.pause_at import signal_and_collect
from tests.faults.test_run_lifecycle import QUIET, _subprocess_env
from tests.helpers import write_recipe

LONG = {"max_steps": 5000, "save_steps": 1000, "save_total_limit": 2, "lr_scheduler": "constant", "warmup_steps": 0}


def _steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("neutrain:") or "Traceback" in line]


def test_sigterm_saves_a_checkpoint_at_a_step_boundary_exits_143_in_one_line_and_resumes(tmp_path):
    recipe = write_recipe(tmp_path, train=LONG, **QUIET)
    out = tmp_path / "out"
    env = {**_subprocess_env(), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "neutrain", "train", str(recipe)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # the per-step log lines: wait until training is under way
        if line.startswith("step 3/"):
            break
    stdout, stderr = signal_and_collect(proc, signal.SIGTERM, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    errors = _error_lines(stderr)
    assert len(errors) == 1 and errors[0].startswith("neutrain: error: stopped by SIGTERM at step "), stderr[-3000:]
    step = int(errors[0].split("at step ")[1].split(":")[0])
    checkpoint = out / f"checkpoint-{step}"
    assert f"saved {checkpoint}" in errors[0]
    assert 3 <= step < LONG["max_steps"]
    verify_checkpoint(checkpoint)  # complete: every file matches its manifest entry
    assert _steps(out)[-1] == step
    assert not list(out.glob(".tmp-*"))

    assert neutrain(["train", str(recipe), "train.resume_from_checkpoint=true", f"train.max_steps={step + 2}"]) == 0
    assert _steps(out)[-3:] == [step, step + 1, step + 2]
    assert (out / f"checkpoint-{step + 2}" / "model.safetensors").is_file()


def _signal_during_step(monkeypatch, step: int, times: int) -> None:
    """Make training step ``step`` send SIGINT to this process ``times`` times (a user's Ctrl-C)."""
    from neutrain.trainer.trainer import NeuTrainer

    original = NeuTrainer.training_step

    def training_step(self, *args, **kwargs):
        if self.state.global_step + 1 == step:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(NeuTrainer, "training_step", training_step)


def test_one_sigint_saves_at_the_step_boundary_and_exits_130(tmp_path, monkeypatch, capsys):
    recipe = write_recipe(tmp_path, train=LONG, **QUIET)
    _signal_during_step(monkeypatch, step=2, times=1)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert neutrain(["train", str(recipe)]) == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert _error_lines(err) == [f"neutrain: error: stopped by SIGINT at step 2: saved {tmp_path / 'out' / 'checkpoint-2'}; "
                                 "continue with train.resume_from_checkpoint=true"], err
    verify_checkpoint(tmp_path / "out" / "checkpoint-2")
    # The handlers are removed after training: the ones the process had before come back. (Compared with
    # what this process had, not with Python's default: pytest started as a background job of a
    # non-interactive shell, `cmd &`, inherits SIGINT ignored, and Python keeps SIG_IGN then.)
    after = {s: signal.getsignal(s) for s in handlers}
    assert after == handlers, f"before training {handlers}, after {after}"


def test_a_second_sigint_stops_at_once_without_saving(tmp_path, monkeypatch, capsys):
    recipe = write_recipe(tmp_path, train=LONG, **QUIET)
    _signal_during_step(monkeypatch, step=2, times=2)
    assert neutrain(["train", str(recipe)]) == 130
    assert _error_lines(capsys.readouterr().err) == ["neutrain: interrupted"]
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_the_step_boundary_is_awaited_for_a_bounded_time_only():
    from neutrain.trainer.signals import StopOnSignal

    expired = []
    stopper = StopOnSignal(grace_s=0.2, on_expire=lambda message, signum: expired.append((message, signum)))
    with stopper.installed():
        stopper.handle(signal.SIGTERM, None)
        deadline = time.monotonic() + 10
        while not expired and time.monotonic() < deadline:
            time.sleep(0.05)
    assert expired and expired[0][1] == signal.SIGTERM
    assert "did not end within 0.2 s" in expired[0][0] and "stopped without saving" in expired[0][0]
    # Reaching the boundary in time cancels the watchdog.
    reached = StopOnSignal(grace_s=0.2, on_expire=lambda *a: pytest.fail("the watchdog fired after the boundary"))
    with reached.installed():
        reached.handle(signal.SIGTERM, None)
        from transformers import TrainerControl, TrainerState, TrainingArguments

        control = reached.on_step_end(TrainingArguments("unused", use_cpu=True, report_to=[]), TrainerState(global_step=7),
                                      TrainerControl())
        time.sleep(0.4)
    assert control.should_save and control.should_training_stop and reached.stopped_at == 7
