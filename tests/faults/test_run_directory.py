"""One run per output directory: a live run's lock, a used directory, stale locks and writers' temporaries.

Before: two runs started at once on one directory both exited 0 with
interleaved metrics and mixed checkpoints; a resume started during another run's save
deleted that run's ``.tmp-checkpoint-N``; a new run into a used directory overwrote its
checkpoints. The lock is exercised by real processes (a run held in the middle of a save,
and two more started against it); the rest runs in-process.
"""

from __future__ import annotations

import hashlib
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
from tests.faults.pause_at import wait_until_paused
from tests.helpers import child_env, write_recipe

REPO = Path(__file__).resolve().parents[2]
QUIET = {"export": {"format": "none"}, "eval": {"perplexity": False}}


def _env() -> dict[str, str]:
    return child_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", DISABLE_TQDM="1",
                     NEUTRAIN_LOG_LEVEL="WARNING")


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("neutrain: error:")]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _loss_steps(out: Path) -> list[int]:
    """The step of every training record in metrics.jsonl, as written (a second writer would repeat steps)."""
    return [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_second_run_and_a_resume_during_a_save_are_refused_and_the_save_survives(tmp_path, capsys):
    recipe = write_recipe(tmp_path, train={"max_steps": 4, "save_steps": 2, "save_total_limit": 3}, **QUIET)
    out, gate = tmp_path / "out", tmp_path / "gate"
    gate.mkdir()
    first = subprocess.Popen([sys.executable, "-m", "tests.faults.pause_during_save", "2", str(gate), "train", str(recipe)],
                             cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_paused(first, gate, "its save")
        # Both started while the first run (another process, holding the lock) is writing checkpoint-2: a new
        # run and a resume. They run in this process: what they meet is the other process's lock and files,
        # and a launch of each would cost an interpreter importing torch.
        for extra in ([], ["train.resume_from_checkpoint=true"]):
            capsys.readouterr()
            assert neutrain(["train", str(recipe), *extra]) == 2
            err = capsys.readouterr().err
            errors = _errors(err)
            assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
            assert f"is in use by another neutrain run (pid {first.pid} on host {socket.gethostname()}" in errors[0]
            assert str(out / ".neutrain.lock") in errors[0]
        # The resume did not take the live run's temporary for a leftover; it names its writer.
        temporary = out / ".tmp-checkpoint-2"
        assert (temporary / "checkpoint-2" / "model.safetensors").is_file()
        assert json.loads((temporary / "writer.json").read_text())["pid"] == first.pid
    finally:
        (gate / "go").write_text("")
        _, err = first.communicate(timeout=240)
    assert first.returncode == 0, err[-3000:]
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-4").is_dir() and not temporary.exists()
    assert _loss_steps(out) == [1, 2, 3, 4]  # one writer: no interleaved or repeated steps
    assert (out / ".neutrain.lock").read_text() == ""  # released at the end


def test_a_new_run_into_a_used_directory_is_refused_unless_overwrite_is_set(tmp_path, capsys):
    recipe = write_recipe(tmp_path, train={"max_steps": 2, "save_steps": 2}, **QUIET)
    out = tmp_path / "out"
    assert neutrain(["train", str(recipe)]) == 0
    before = _tree(out)
    capsys.readouterr()
    assert neutrain(["train", str(recipe), "train.learning_rate=1e-3"]) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and "holds another run's checkpoints (checkpoint-2)" in errors[0], errors
    assert "train.resume_from_checkpoint=true" in errors[0] and "train.overwrite_output_dir=true" in errors[0]
    assert _tree(out) == before  # nothing overwritten, nothing appended to metrics.jsonl
    assert neutrain(["train", str(recipe), "train.learning_rate=1e-3", "train.overwrite_output_dir=true"]) == 0
    assert _loss_steps(out) == [1, 2]  # the old run's records were deleted with its checkpoints, not mixed in
    recorded = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert [h["learning_rate"] for h in recorded["log_history"] if "loss" in h][-1] == pytest.approx(1e-3)


def test_a_stale_lock_is_taken_over_and_a_live_or_foreign_one_refused(tmp_path, caplog):
    from neutrain.storage.run_lock import LOCK_FILE, RunDirectoryError, RunLock, release

    out = tmp_path / "out"
    out.mkdir()
    lock = out / LOCK_FILE
    here = socket.gethostname()
    lock.write_text(json.dumps({"pid": _dead_pid(), "host": here, "started": "earlier"}))  # a run killed by SIGKILL
    with caplog.at_level(logging.WARNING, logger="neutrain"):
        RunLock(out).acquire()
    assert "took over the stale lock" in caplog.text and json.loads(lock.read_text())["pid"] == os.getpid()
    release(out)
    assert lock.read_text() == ""
    # A file system without flock: only the record speaks. A live pid on this host that has the file open
    # (as a run keeps its lock open) is a live run.
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); time.sleep(60)",
                               str(lock)])
    try:
        lock.write_text(json.dumps({"pid": holder.pid, "host": here, "started": "now"}))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _has_open(holder.pid, lock):
            time.sleep(0.05)
        with pytest.raises(RunDirectoryError, match=f"in use by another neutrain run \\(pid {holder.pid} on host"):
            RunLock(out).acquire()
    finally:
        holder.kill()
        holder.wait()
    # Another host's pid cannot be checked from here: refused, naming the file to delete.
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere.example", "started": "now"}))
    with pytest.raises(RunDirectoryError, match=f"on another host .*elsewhere.example.*delete {lock}"):
        RunLock(out).acquire()
    assert json.loads(lock.read_text())["host"] == "elsewhere.example"  # a refusal leaves the record alone
    # A flock held by another open file (another process's, as the real-process test shows) refuses at once.
    import fcntl

    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(RunDirectoryError, match="in use by another neutrain run"):
            RunLock(out).acquire()
    finally:
        os.close(fd)


def _has_open(pid: int, path) -> bool:
    from neutrain.storage.leftovers import holds_open

    return bool(holds_open(pid, path))


def test_only_a_dead_writers_temporary_checkpoint_is_cleaned(tmp_path):
    from neutrain.storage.leftovers import clean_run_dir

    here = socket.gethostname()
    # Alive: another process that records itself as a running save does (pid and start time), and waits.
    # (This process cannot stand in: a run's own old temporaries are stale to it.) Dead: a pid no process holds.
    saver = subprocess.Popen([sys.executable, "-c", "import json, sys; from neutrain.storage.leftovers import "
                              "this_writer; print(json.dumps(this_writer()), flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        writers = {".tmp-checkpoint-2": json.loads(saver.stdout.readline()),
                   ".tmp-checkpoint-4": {"pid": _dead_pid(), "host": here, "started": "now"}}
        for name, record in writers.items():
            (tmp_path / name / name[5:]).mkdir(parents=True)
            (tmp_path / name / "writer.json").write_text(json.dumps(record))
        actions = clean_run_dir(tmp_path)
    finally:
        saver.communicate("")
    assert (tmp_path / ".tmp-checkpoint-2" / "checkpoint-2").is_dir()  # its writer is running: kept
    assert not (tmp_path / ".tmp-checkpoint-4").exists()
    assert actions == [f"removed {tmp_path / '.tmp-checkpoint-4'} (temporary left by an interrupted or failed write)"]
