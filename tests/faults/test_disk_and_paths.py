"""What a run will write is checked before its first step (path lengths, disk space), and a save that fails
removes what it wrote.

Before: an ``export.output_dir`` too long for the file system failed after all the training, naming a hidden
staging folder; a full disk was found at the final save, which left its partial checkpoint behind (the next
run on that disk then failed within seconds). In-process; the free space is what ``shutil.disk_usage``
reports, replaced here.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from neutrain.cli import main as neutrain
from neutrain.storage.manifest import verify_checkpoint
from tests.helpers import one_error_line, write_recipe

QUIET = {"eval": {"perplexity": False}}


def _deep(root: Path, length: int) -> Path:
    """A directory under ``root`` whose absolute path has about ``length`` bytes (names of 200)."""
    path = root
    while len(str(path)) + 201 < length:
        path = path / ("d" * 200)
    return path / ("e" * max(1, length - len(str(path)) - 1))


LONG = {  # key -> recipe sections whose planned paths the file system cannot hold
    "export-name-past-NAME_MAX": lambda tmp: ("export.output_dir", {"export": {"format": "hf",
                                                                              "output_dir": str(tmp / ("x" * 247))}}),
    "run-path-near-PATH_MAX": lambda tmp: ("train.output_dir", {"train": {"output_dir": str(_deep(tmp, 4040))},
                                                               "export": {"format": "none"}}),
    "export-path-near-PATH_MAX": lambda tmp: ("export.output_dir", {"export": {"format": "hf",
                                                                              "output_dir": str(_deep(tmp, 4060))}}),
}


@pytest.mark.parametrize("case", LONG)
def test_an_output_path_too_long_for_the_file_system_is_refused_before_training_naming_its_key(tmp_path, capsys, case):
    key, sections = LONG[case](tmp_path)
    train = {"max_steps": 2, "save_steps": 1, **sections.pop("train", {})}
    recipe = write_recipe(tmp_path, train=train, **QUIET, **sections)
    assert neutrain(["train", str(recipe)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"neutrain: error: {key}: ") and "too long for its file system" in line, line
    out = Path(train.get("output_dir", tmp_path / "out"))
    assert not (out / "metrics.jsonl").exists()  # refused before the first step


_Usage = namedtuple("_Usage", "total used free")

SPACE = {  # train keys, export format -> refused for want of space?
    "two-saves-and-an-export": ({"max_steps": 2, "save_steps": 1, "save_total_limit": 2}, "hf", True),
    "the-final-save-only": ({"max_steps": 2, "save_steps": 10}, "none", True),
    "an-export-only": ({"max_steps": 2, "save_steps": 10, "save_final": False}, "hf", True),
    "a-benchmark-saving-nothing": ({"max_steps": 2, "save_steps": 10, "save_final": False}, "none", False),
}


@pytest.mark.parametrize("case", SPACE)
def test_a_disk_too_small_for_the_saves_and_the_export_is_refused_before_the_first_step(tmp_path, capsys, monkeypatch,
                                                                                        case):
    train, fmt, refused = SPACE[case]
    recipe = write_recipe(tmp_path, train=train, eval={"perplexity": False}, export={"format": fmt})
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(real(path).total, real(path).total - 4096, 4096))
    code = neutrain(["train", str(recipe)])
    out = tmp_path / "out"
    if not refused:
        assert code == 0, capsys.readouterr().err
        assert not [p for p in os.listdir(out) if p.startswith("checkpoint-")]
        return
    assert code == 2
    line = one_error_line(capsys.readouterr().err)
    # Each size in a unit that shows it: 4 KiB free, never "0.00 GiB free" against a need of "0.01 GiB".
    assert "has 4.00 KiB free" in line and "this run needs" in line and " 0.00 " not in line, line
    assert not (out / "metrics.jsonl").exists()  # no step was trained


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


FAILURES = {  # where the second save fails: the function, and the path among its arguments
    "writing-the-optimizer": ("torch.save", lambda args: str(args[1]).endswith("optimizer.pt")),
    "writing-the-manifest": ("neutrain.trainer.trainer.write_manifest", lambda args: True),
    "syncing-before-the-rename": ("neutrain.trainer.trainer.fsync_tree", lambda args: True),
}


@pytest.mark.parametrize("where", FAILURES)
def test_a_save_that_fails_removes_its_partial_files_and_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch,
                                                                                   where):
    import importlib

    target, applies = FAILURES[where]
    module_name, name = target.rsplit(".", 1)
    module = importlib.import_module(module_name)
    original = getattr(module, name)

    def failing_at_the_second_save(*args, **kwargs):
        if any("checkpoint-2" in str(a) for a in args) and applies(args):
            _enospc()
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, failing_at_the_second_save)
    recipe = write_recipe(tmp_path, train={"max_steps": 2, "save_steps": 1, "save_total_limit": 3},
                          eval={"perplexity": False}, export={"format": "none"})
    assert neutrain(["train", str(recipe)]) == 1
    assert "disk full" in one_error_line(capsys.readouterr().err)
    out = tmp_path / "out"
    assert not [p for p in os.listdir(out) if p.startswith(".tmp-")], os.listdir(out)
    assert not (out / "checkpoint-2").exists()
    verify_checkpoint(out / "checkpoint-1")
