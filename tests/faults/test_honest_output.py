"""Numbers and words that go out say what happened: perplexity, accumulation, the argument order the help shows,
an old lock file, and a stdout that fails.

A held-out loss of 1063 printed "perplexity 5184705528587072045056.00" (the clamp at 50 nats, shown as a
measurement); accumulating 8 micro-batches over a 3-row epoch said nothing; ``neutrain eval CKPT --recipe R
eval.max_eval_samples=2`` was "unrecognized arguments"; a lock file in the previous release's format blocked
the run naming "pid 1 on host vm"; ``neutrain ... | head -2`` and ``> /dev/full`` ended with "Broken pipe
(RUN)" or "disk full (RUN)", blaming the run directory for standard output.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import os
import socket
import subprocess
import sys

import pytest

from neutrain.cli import main as neutrain
from neutrain.cli.after_training import format_summary
from neutrain.cli.main import COMMANDS, _parser
from tests.faults.test_run_directory import REPO, _dead_pid, _env
from tests.helpers import write_recipe

PACKAGE = REPO / "neutrain"


@pytest.mark.parametrize("loss,printed,record", [
    (0.0, "loss 0.0000, perplexity 1.00", 1.0),
    (2.0, "loss 2.0000, perplexity 7.39", math.exp(2.0)),
    (20.0, "loss 20.0000, perplexity 4.85e+08", math.exp(20.0)),
    (50.0, "loss 50.0000, perplexity 5.18e+21", math.exp(50.0)),
    (50.5, "loss 50.5000, perplexity inf (a loss past 50 nats: the model diverged)", None),
    (1063.0, "loss 1063.0000, perplexity inf (a loss past 50 nats: the model diverged)", None),
    (math.inf, "loss inf, perplexity inf (a loss past 50 nats: the model diverged)", None),
    (math.nan, "loss nan, perplexity nan (the loss is not a number)", None),
])
def test_perplexity_is_exp_of_the_loss_or_inf_past_its_bound_with_the_loss_beside_it(loss, printed, record):
    from neutrain.eval.perplexity import perplexity_record, perplexity_text

    assert perplexity_text(loss) == printed
    assert perplexity_record(loss) == record
    summary = {"heldout_loss": loss, "heldout_perplexity": record, "output_dir": "o", "wall_time_s": 1.0}
    assert f"held-out        {printed}" in format_summary(summary)
    if math.isfinite(loss):
        json.dumps(summary, allow_nan=False)  # the record is JSON: no Infinity in it


def test_perplexity_is_computed_in_one_place():
    """No module but neutrain.eval.perplexity turns a loss into a perplexity (``math.exp`` where perplexity is)."""
    stray = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if "perplexity" not in source or path.name == "perplexity.py":
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("math.exp", "np.exp", "numpy.exp", "exp"):
                stray.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert not stray, "perplexity computed outside neutrain.eval.perplexity:\n" + "\n".join(stray)


@pytest.mark.parametrize("rows,micro,accumulation,processes,warned", [
    (3, 1, 8, 1, 3), (3, 1, 1000, 1, 3), (3, 1, 6, 1, 3), (3, 1, 3, 1, None), (10, 4, 3, 1, None),
    (10, 4, 4, 1, 3), (16, 2, 8, 2, 4), (16, 2, 4, 2, None), (0, 1, 8, 1, None),
])
def test_accumulation_past_the_epochs_micro_batches_is_named(rows, micro, accumulation, processes, warned):
    from neutrain.cli.preflight import accumulation_note

    note = accumulation_note(rows, micro, accumulation, processes)
    if warned is None:
        assert note is None
    else:
        assert note.startswith(f"train.gradient_accumulation_steps: {accumulation} micro-batches per optimizer step, "
                               f"but an epoch has only {warned} ") and note.endswith(f"trains as with {warned}")


COMMANDS_WITH_OVERRIDES = {name: argv for name, argv in {
    "train": ["train", "r.yaml"], "eval": ["eval", "ckpt", "--recipe", "r.yaml"], "estimate": ["estimate", "r.yaml"],
    "distill": ["distill", "r.yaml", "--overwrite"],
}.items()}


def test_every_command_with_overrides_is_one_the_table_covers():
    import argparse

    def subparser(name):  # each command's arguments are configured only in a parser made for it
        subparsers = next(a for a in _parser(name)._actions if isinstance(a, argparse._SubParsersAction))
        assert set(subparsers.choices) == set(COMMANDS)
        return subparsers.choices[name]

    takes = {name for name in COMMANDS if any(a.dest == "overrides" for a in subparser(name)._actions)}
    assert takes == set(COMMANDS_WITH_OVERRIDES)


@pytest.mark.parametrize("command", sorted(COMMANDS_WITH_OVERRIDES))
def test_overrides_after_an_option_are_overrides(command):
    from neutrain.cli.main import _parse

    argv = COMMANDS_WITH_OVERRIDES[command]
    overrides = ["eval.max_eval_samples=2", "train.max_steps=3"]
    parser = _parser(command)
    before = _parse(parser, [*argv[:2], *overrides, *argv[2:]])
    after = _parse(parser, [*argv, *overrides])
    split = _parse(parser, [*argv[:2], overrides[0], *argv[2:], overrides[1]])
    assert before.overrides == after.overrides == split.overrides == overrides
    assert vars(before) == vars(after) == vars(split)
    with pytest.raises(SystemExit):
        _parse(parser, [*argv, "--no-such-option"])


def test_eval_of_a_checkpoint_takes_overrides_after_the_recipe_option(tmp_path, capsys, caplog):
    """The command line the help shows, options first, end to end; the same run warns about accumulation on a 3-row epoch."""
    data, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i} " * 5}) + "\n" for i in range(3)))  # one row each
    held.write_text("".join(json.dumps({"text": f"held {i} " * 5}) + "\n" for i in range(4)))
    recipe = write_recipe(tmp_path, data={"datasets": [{"path": str(data), "type": "text"},
                                                       {"path": str(held), "type": "text", "split": "validation"}],
                                          "sample_packing": False},
                          train={"max_steps": 1, "save_steps": 1, "micro_batch_size": 1, "gradient_accumulation_steps": 8},
                          eval={"perplexity": False}, export={"format": "none"})
    with caplog.at_level(logging.WARNING, logger="neutrain"):
        assert neutrain(["train", str(recipe)]) == 0
    assert "train.gradient_accumulation_steps: 8 micro-batches per optimizer step, but an epoch has only 3" in caplog.text
    capsys.readouterr()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert neutrain(["eval", str(checkpoint), "--recipe", str(recipe), "eval.max_eval_samples=2",
                     "eval.perplexity=true"]) == 0
    out = capsys.readouterr().out
    assert "held-out loss " in out and "(2 rows," in out, out
    results = json.loads((tmp_path / "out" / "eval" / "eval_results.json").read_text())
    assert results["heldout_perplexity"] is None or math.isfinite(results["heldout_perplexity"])


# ---- lock files in the previous release's format -------------------------------------------------------------

def _holding(path):
    return subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); print(1, flush=True); "
                             "time.sleep(60)", str(path)], stdout=subprocess.PIPE)


@pytest.mark.parametrize("holder,taken", [
    ("pid 1", True),  # alive, but a container's or the machine's first process: not a run
    ("dead pid", True),
    ("pid of an unrelated process", True),
    ("live process with the file open", False),
])
def test_a_lock_in_the_previous_format_counts_only_while_its_pid_holds_the_file(tmp_path, caplog, holder, taken):
    from neutrain.storage.run_lock import LOCK_FILE, RunDirectoryError, RunLock, release

    out = tmp_path / "out"
    out.mkdir()
    lock = out / LOCK_FILE
    lock.write_text("")
    other = None
    try:
        if holder == "pid 1":
            pid = 1
        elif holder == "dead pid":
            pid = _dead_pid()
        elif holder == "pid of an unrelated process":
            other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            pid = other.pid
        else:
            other = _holding(lock)
            other.stdout.readline()  # the file is open
            pid = other.pid
        # What the previous release wrote: pid, host and start time, nothing that tells a process apart.
        lock.write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": "2026-11-20T10:00:00+0000"}))
        if taken:
            with caplog.at_level(logging.WARNING, logger="neutrain"):
                RunLock(out).acquire()
            assert "took over the stale lock" in caplog.text and json.loads(lock.read_text())["pid"] == os.getpid()
            release(out)
        else:
            with pytest.raises(RunDirectoryError, match=f"in use by another neutrain run \\(pid {pid} on host"):
                RunLock(out).acquire()
    finally:
        if other is not None:
            other.kill()
            other.wait()


def test_a_temporary_checkpoint_whose_old_format_record_names_pid_1_is_cleaned(tmp_path):
    from neutrain.storage.leftovers import clean_run_dir

    temporary = tmp_path / ".tmp-checkpoint-2"
    temporary.mkdir()
    (temporary / "writer.json").write_text(json.dumps({"pid": 1, "host": socket.gethostname(),
                                                       "started": "2026-11-20T10:00:00+0000"}))
    assert clean_run_dir(tmp_path) and not temporary.exists()


# ---- standard output's failures are standard output's --------------------------------------------------------

def _neutrain(args, stdout, env=None):
    return subprocess.Popen([sys.executable, "-m", "neutrain", *map(str, args)], cwd=REPO, env=env or _env(),
                            stdout=stdout, stderr=subprocess.PIPE, text=True)


# A run is the costly case: it is run once, into a reader that has gone (its output fails in the middle of the
# run); a full stdout fails the same writer, shown on a command that prints at once.
@pytest.mark.parametrize("command,stdout", [("recipes", "closed pipe"), ("recipes", "/dev/full"), ("train", "closed pipe")])
def test_a_failing_stdout_is_named_as_stdout_never_as_the_run_directory(tmp_path, command, stdout):
    args = [command]
    if command == "train":
        args += [write_recipe(tmp_path, train={"max_steps": 1, "save_steps": 1}, eval={"perplexity": False},
                              export={"format": "none"})]
    if stdout == "closed pipe":  # `| head -0`: the reader is gone before the first line
        read, write = os.pipe()
        os.close(read)
        proc = _neutrain(args, write)
        os.close(write)
    else:
        with open("/dev/full", "w") as full:
            proc = _neutrain(args, full)
    _, err = proc.communicate(timeout=240)
    assert "Traceback" not in err and "Exception ignored" not in err and str(tmp_path) not in err, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("neutrain: error:")]
    if stdout == "closed pipe":
        assert proc.returncode == 0 and not errors, err[-2000:]  # quiet: the reader wanted no more
    else:
        assert proc.returncode == 1 and errors == ["neutrain: error: stdout: No space left on device (the command's "
                                                   "output could not be written; its other files are unaffected)"], err
    if command == "train":
        assert (tmp_path / "out" / "summary.json").is_file()  # the run itself finished and recorded it
