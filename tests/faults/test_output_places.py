"""Every folder a command writes is checked where it is named: not a FIFO or a device, and not inside another run.

Why: ``train.output_dir`` set to a FIFO or ``/dev/null`` was "not writable (...): Not a directory", exit 1, as if the
disk had failed, and ``export --output FIFO`` called it "a file"; a new run whose ``train.output_dir`` lay inside
another run's folder (``RUN/newsub``, not only ``RUN/checkpoint-N`` or ``RUN/export``) was written there, unlisted
in a folder RUN's overwrite and rotation own. Both are tables over every key and command that names an output
folder; the other run is left byte for byte as it was.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

from tests.helpers import one_error_line, write_recipe


@pytest.fixture(scope="module")
def run(tiny_run, tmp_path_factory) -> Path:
    """The session's finished tiny run (RUN, with its checkpoint-2 and export; tests/faults/conftest.py), read only,
    and a copy of its checkpoint outside it (``run.parent / "loose-checkpoint"``: beside the run, not in it)."""
    loose = tiny_run.parent / "loose-checkpoint"
    if not loose.exists():
        shutil.copytree(tiny_run / "checkpoint-2", loose)
    return tiny_run


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file()}


def _commands(run: Path, tmp_path: Path, target: str) -> dict[str, tuple[list[str], str]]:
    """Each command naming ``target`` as the folder it writes: (argv, the key its refusal names)."""
    recipe = write_recipe(tmp_path / "new")
    elsewhere = f"train.output_dir={tmp_path / 'elsewhere'}"
    return {
        "train train.output_dir": (["train", str(recipe), f"train.output_dir={target}"], "train.output_dir"),
        "train export.output_dir": (["train", str(recipe), elsewhere, f"export.output_dir={target}"],
                                    "export.output_dir"),
        "export --output": (["export", str(run.parent / "loose-checkpoint"), "--output", target], "--output"),
        "eval train.output_dir": (["eval", str(run.parent / "loose-checkpoint"), "--recipe", str(recipe),
                                   f"train.output_dir={target}"], "train.output_dir"),
        "distill train.output_dir": (["distill", str(recipe), f"train.output_dir={target}"], "train.output_dir"),
    }


COMMANDS = ["train train.output_dir", "train export.output_dir", "export --output", "eval train.output_dir",
            "distill train.output_dir"]


def _special(tmp_path: Path, kind: str) -> tuple[str, str]:
    """A path of ``kind`` and the word its refusal must hold."""
    if kind in ("FIFO", "under a FIFO"):
        os.mkfifo(tmp_path / "pipe")
        return str(tmp_path / "pipe") + ("/run" if kind == "under a FIFO" else ""), "is a FIFO"
    if kind == "socket":
        path = tmp_path / "sock"
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.close()
        return str(path), "is a socket"
    return ("/dev/null" if kind == "device" else "/dev/null/run"), "is a character device"


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", ["FIFO", "under a FIFO", "device", "under a device", "socket"])
def test_an_output_folder_that_is_a_fifo_or_a_device_is_one_line_naming_the_key_and_kind(run, tmp_path, capsys,
                                                                                         command, kind):
    from neutrain.cli import main

    target, word = _special(tmp_path, kind)
    argv, key = _commands(run, tmp_path, target)[command]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert key in line and word in line and ("lies under" in line) == kind.startswith("under"), line
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("place", ["newsub", "deep/er/sub", "tokenizer/sub"])
def test_an_output_folder_inside_another_run_is_refused_naming_both(run, tmp_path, capsys, command, place):
    from neutrain.cli import main

    before = _snapshot(run)
    target = run / place
    argv, key = _commands(run, tmp_path, str(target))[command]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert key in line and str(target) in line and f"run {run}" in line, line
    assert _snapshot(run) == before
    assert place.startswith("tokenizer") or not (run / place.split("/")[0]).exists()


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_output_folder_holding_a_run_never_deletes_it(run, tmp_path, capsys, overwrite):
    from neutrain.cli import main

    holder = run.parent
    before = _snapshot(holder)
    recipe = write_recipe(tmp_path / "new")
    for argv in (["train", str(recipe), f"train.output_dir={holder}", f"train.overwrite_output_dir={overwrite}"],
                 ["train", str(recipe), f"train.output_dir={tmp_path / 'elsewhere'}", f"export.output_dir={holder}"]):
        assert main(argv) == 2
        line = one_error_line(capsys.readouterr().err)
        assert str(holder) in line, line
    assert _snapshot(holder) == before


def test_a_runs_own_export_and_an_export_into_its_own_run_are_allowed(run):
    from neutrain.storage.run_dir import enclosing_run, refuse_inside_model

    # As `neutrain export RUN/checkpoint-2 --output RUN/export-again` and a run's own export.output_dir judge them.
    refuse_inside_model(run / "export-again", "--output", may_be_one=True, own=enclosing_run(run / "checkpoint-2"))
    refuse_inside_model(run / "export", "export.output_dir", may_be_one=True, own=run)
