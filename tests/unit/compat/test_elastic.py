"""torch elastic's launcher after neutrain's refusals: torch reads the error files neutrain writes, and the
excepthook neutrain-recipe.pth installs ends such a launch without the launcher's traceback, printing only
the lines no process said. Anything else keeps torch's report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from neutrain.compat.elastic import STOPPED, record_refusal, unsaid_refusals
from neutrain.config.recipe_codec import PTH_LINE

REPO = Path(__file__).resolve().parents[3]
LINE = "neutrain: error: train.max_steps: 0 trains nothing"

def _hook(previous):
    """``sys.excepthook`` as neutrain-recipe.pth leaves it in a launcher whose hook was ``previous``."""
    saved = sys.excepthook
    sys.excepthook = previous
    try:
        exec(PTH_LINE, {})
        return sys.excepthook
    finally:
        sys.excepthook = saved


def _launch_failed(tmp_path, failures):
    """The ``ChildFailedError`` a launcher raises, its failures read by torch from the processes' error files."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    read = {}
    for rank, (code, line, said) in enumerate(failures):
        path = tmp_path / f"{rank}.json"
        if line is not None:
            record_refusal(line, said, {"TORCHELASTIC_ERROR_FILE": str(path)})
        read[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file=str(path))
    return ChildFailedError("neutrain", read)


@pytest.mark.parametrize("failures,printed", [
    ([(2, LINE, True), (STOPPED, None, False)], ""),  # the first said it; the agent stopped the other
    ([(2, LINE, True), (2, LINE, False)], ""),  # both refused; the first said it
    ([(STOPPED, None, False), (2, LINE, False)], LINE + "\n"),  # the other refused first: no one said it yet
    ([(2, LINE, False), (2, "neutrain: error: y", False)], LINE + "\nneutrain: error: y\n"),
], ids=["said", "said-once", "unsaid", "two-lines"])
def test_a_launch_ended_by_refusals_prints_the_unsaid_lines_and_no_traceback(tmp_path, capsys, failures, printed):
    reached = []
    error = _launch_failed(tmp_path, failures)
    _hook(lambda *exc: reached.append(exc))(type(error), error, None)
    assert capsys.readouterr().err == printed and not reached


@pytest.mark.parametrize("failures", [
    [(2, LINE, True), (1, None, False)],  # one process crashed: its report is the launcher's
    [(STOPPED, None, False)],  # stopped, and no refusal
])
def test_any_other_failure_keeps_the_launchers_report(tmp_path, capsys, failures):
    reached = []
    error = _launch_failed(tmp_path, failures)
    _hook(lambda *exc: reached.append(exc))(type(error), error, None)
    assert reached == [(type(error), error, None)] and capsys.readouterr().err == ""


def test_other_exceptions_reach_the_hook_that_was_there():
    reached = []
    error = ValueError("not a launch")
    _hook(lambda *exc: reached.append(exc))(ValueError, error, None)
    assert reached == [(ValueError, error, None)]


@pytest.mark.slow
def test_a_launcher_ended_by_a_refusal_exits_non_zero_without_a_traceback(tmp_path):
    probe = (f"exec({PTH_LINE!r})\n"
             "from tests.unit.compat.test_elastic import _launch_failed\n"
             "from pathlib import Path\n"
             f"raise _launch_failed(Path({str(tmp_path)!r}), [(2, {LINE!r}, False)])\n")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert res.returncode == 1 and res.stderr == LINE + "\n", res.stderr


def test_a_launcher_without_the_hook_shows_the_line_in_its_report(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    path = tmp_path / "error.json"
    record_refusal(LINE, True, {"TORCHELASTIC_ERROR_FILE": str(path)})
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(path))
    assert f"traceback : {LINE}" in ChildFailedError("neutrain", {0: failure}).format_msg()
    assert unsaid_refusals({0: failure}) == []


def test_no_error_file_outside_an_elastic_launch(tmp_path):
    record_refusal(LINE, True, {"TORCHELASTIC_ERROR_FILE": ""})  # the agent's "no log folder"
    record_refusal(LINE, True, {"TORCHELASTIC_ERROR_FILE": str(tmp_path / "gone" / "error.json")})  # unwritable
    assert not list(tmp_path.iterdir())
