"""Every command that writes into a run directory holds its lock, and only a live run's lock is respected.

``neutrain distill`` took no lock: two at once interleaved their logs, and one ran beside a training
run in the same directory. A stale lock whose pid had been reused by an unrelated process was never
taken over (the pid looked alive). The first test holds a real ``neutrain distill`` process inside its
training while others start against it; the second names a real, unrelated live process in the lock.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neutrain.cli import main as neutrain
from tests.faults.test_run_directory import REPO, _env
from tests.helpers import one_error_line, write_recipe


def _wait_for_pause(proc: subprocess.Popen, gate: Path) -> None:
    deadline = time.monotonic() + 240
    while not (gate / "paused").exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the paused process never reached its pause"
        time.sleep(0.1)


def test_distill_holds_the_run_lock_against_a_second_distill_and_a_training_run(tmp_path, capsys):
    recipe = write_recipe(tmp_path, train={"max_steps": 2, "save_steps": 2}, eval={"perplexity": False},
                          distill={"max_steps": 2, "max_new_tokens": 4})
    out, gate = tmp_path / "out", tmp_path / "gate"
    assert neutrain(["train", str(recipe)]) == 0  # the target: out/export
    gate.mkdir()
    first = subprocess.Popen([sys.executable, "-m", "tests.faults.pause_at",
                              "neutrain.distill.trainer:DistillationTrainer.train", str(gate), "distill", str(recipe)],
                             cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_pause(first, gate)
        capsys.readouterr()
        for command in (["distill", str(recipe)], ["train", str(recipe), "train.max_steps=4",
                                                   "train.resume_from_checkpoint=true"]):
            assert neutrain(command) == 2, command
            line = one_error_line(capsys.readouterr().err)
            assert f"is in use by another neutrain run (pid {first.pid} on host {socket.gethostname()}" in line, line
        assert not (out / "checkpoint-4").exists()
    finally:
        (gate / "go").write_text("")
        _, err = first.communicate(timeout=240)
    assert first.returncode == 0, err[-3000:]
    assert (out / "draft" / "config.json").is_file()
    assert (out / ".neutrain.lock").read_text() == ""  # released at the end


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="a process's start time is read from /proc")
def test_a_stale_lock_whose_pid_now_belongs_to_an_unrelated_process_is_taken_over(tmp_path, caplog):
    from neutrain.storage.leftovers import clean_run_dir
    from neutrain.storage.run_lock import LOCK_FILE, RunDirectoryError, RunLock, release

    out = tmp_path / "out"
    out.mkdir()
    lock = out / LOCK_FILE
    unrelated = subprocess.Popen(["sleep", "120"])  # holds the pid the dead run once had
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ticks = int(Path(f"/proc/{unrelated.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])  # starttime
        identity = f"{boot}:{ticks}"
        dead_run = {"pid": unrelated.pid, "host": socket.gethostname(), "started": "earlier",
                    "process": f"{boot}:{ticks - 1}"}  # the run that wrote it started before this process
        lock.write_text(json.dumps(dead_run))
        temporary = out / ".tmp-checkpoint-4"
        (temporary / "checkpoint-4").mkdir(parents=True)
        (temporary / "writer.json").write_text(json.dumps(dead_run))
        with caplog.at_level(logging.WARNING, logger="neutrain"):
            RunLock(out).acquire()
        assert "took over the stale lock" in caplog.text
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        assert clean_run_dir(out) == [f"removed {temporary} (temporary left by an interrupted or failed write)"]
        release(out)
        # The same pid with its own start time is the live process that wrote the record: refused.
        lock.write_text(json.dumps({**dead_run, "process": identity}))
        with pytest.raises(RunDirectoryError, match=f"in use by another neutrain run \\(pid {unrelated.pid} "):
            RunLock(out).acquire()
    finally:
        unrelated.kill()
        unrelated.wait()


# What a lock file left behind may hold: the current format, an older one (no start time), and records
# written by hand or torn (no host, a host of null, a pid that is text or past any pid).
STALE_RECORDS = {
    "current format": {"pid": 1, "host": "{host}", "started": "earlier"},
    "no start time": {"pid": 1, "host": "{host}"},
    "no host": {"pid": 1},
    "a null host": {"pid": 1, "host": None, "started": None},
    "a text pid": {"pid": "1", "host": "{host}"},
    "a pid past any pid": {"pid": 10 ** 30},
    "not an object": [1],
}


@pytest.mark.parametrize("record", STALE_RECORDS)
def test_a_stale_lock_in_any_form_is_taken_over_and_named_without_none(tmp_path, caplog, record):
    from neutrain.storage.run_lock import LOCK_FILE, RunLock, release

    out = tmp_path / "out"
    out.mkdir()
    text = json.dumps(STALE_RECORDS[record]).replace("{host}", socket.gethostname())
    (out / LOCK_FILE).write_text(text)
    with caplog.at_level(logging.WARNING, logger="neutrain"):
        RunLock(out).acquire()  # pid 1 holds no lock file open: the record is stale
    try:
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert "None" not in caplog.text and "another host" not in caplog.text, caplog.text
    finally:
        release(out)


def test_only_a_lock_naming_another_host_is_refused_and_the_message_names_it(tmp_path):
    from neutrain.storage.run_lock import LOCK_FILE, RunDirectoryError, RunLock

    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
    with pytest.raises(RunDirectoryError) as caught:
        RunLock(out).acquire()
    assert "on another host (pid 1 on host elsewhere)" in str(caught.value) and "None" not in str(caught.value)
