"""Every name a run writes at the top of its directory is checked for what stands there before the run writes it.

Before: only a symlink leading outside the run was refused. ``training_curves.png`` linked to
``checkpoint-2/model.safetensors`` wrote the plot over the checkpoint's weights at the end of a resumed run
(exit 0); a ``metrics.jsonl`` hard-linked to a file elsewhere (a run copied with ``cp -al``) grew under both
names; a folder named ``summary.json`` or ``training_curves.png`` failed as "Is a directory" after all the
training; TensorBoard's ``runs`` was not among the names checked at all. The table crosses every name
(:data:`neutrain.storage.confine.RUN_FILES`, so a name added there is covered) with each thing that may stand
in its place.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from neutrain.cli import main
from neutrain.storage.confine import DIR_OUTPUTS, RUN_FILES, ConfinementError, check_run_outputs
from neutrain.storage.run_dir import PLANNED
from tests.helpers import one_error_line

HAZARDS = ["link onto a checkpoint's file", "link onto a checkpoint", "link onto another output",
           "link onto the run itself", "link into a model kept in the run", "the other kind", "a hard link"]


def _run_dir(root: Path) -> Path:
    """A run's directory as the checks see it: a checkpoint, a user's folder holding a model, and each output."""
    (root / "checkpoint-2").mkdir(parents=True)
    (root / "checkpoint-2" / "model.safetensors").write_bytes(b"weights")
    (root / "checkpoint-2" / "neutrain_manifest.json").write_text("{}")
    (root / "kept" / "model").mkdir(parents=True)
    (root / "kept" / "model" / "neutrain_export.json").write_text("{}")
    (root / "logs").mkdir()
    return root


def _plant(root: Path, name: str, hazard: str) -> Path | None:
    """Put ``hazard`` where ``name`` goes; returns the file it must leave unchanged, if any."""
    place, folder = root / name, name in DIR_OUTPUTS
    other = next(n for n in RUN_FILES if n != name and (n in DIR_OUTPUTS) == folder)
    if hazard == "link onto a checkpoint's file":
        target = root / "checkpoint-2" / ("" if folder else "model.safetensors")
    elif hazard == "link onto a checkpoint":
        target = root / "checkpoint-2" / ("sub" if folder else "new.bin")
        if folder:
            target.mkdir()
    elif hazard == "link onto another output":
        target = root / other
        target.mkdir() if folder else target.write_text("the run's own")
    elif hazard == "link onto the run itself":
        target = root
    elif hazard == "link into a model kept in the run":
        target = root / "kept" / "model" / ("" if folder else "config.json")
    elif hazard == "the other kind":
        place.write_text("a file") if folder else place.mkdir()
        return None
    else:  # a hard link: a file the run writes in place, sharing its bytes with a name outside the run
        outside = root.parent / "elsewhere.jsonl"
        outside.write_text("the user's")
        os.link(outside, place)
        return outside
    place.symlink_to(target)
    return target if target.is_file() else None


@pytest.mark.parametrize(("name", "hazard"), [(n, h) for n in RUN_FILES for h in HAZARDS
                                             if not (h == "a hard link" and n in DIR_OUTPUTS)])  # folders have none
def test_what_stands_where_the_run_writes_is_refused_naming_it(tmp_path, name, hazard):
    root = _run_dir(tmp_path / "run")
    kept = _plant(root, name, hazard)
    before = kept.read_bytes() if kept is not None else None
    with pytest.raises(ConfinementError) as refused:
        check_run_outputs(root)
    message = str(refused.value)
    assert message.startswith(f"'{root / name}' ") and "\n" not in message, message
    if kept is not None:
        assert kept.read_bytes() == before


@pytest.mark.parametrize("name", RUN_FILES)
def test_a_link_into_a_folder_of_the_users_own_is_followed(tmp_path, name):
    root = _run_dir(tmp_path / "run")
    target = root / "logs" / name
    target.mkdir() if name in DIR_OUTPUTS else target.write_text("moved by the user")
    (root / name).symlink_to(target)
    check_run_outputs(root)


def test_every_name_a_run_plans_is_checked():
    assert set(PLANNED) <= set(RUN_FILES)


def test_a_plot_linked_onto_a_checkpoint_is_refused_before_the_resume_trains(tiny_run, tmp_path, capsys):
    run = tmp_path / "out"
    shutil.copytree(tiny_run, run, symlinks=True)
    weights = run / "checkpoint-2" / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    (run / "training_curves.png").unlink()
    (run / "training_curves.png").symlink_to(weights)
    code = main(["train", str(tiny_run.parent / "tiny.yaml"), f"train.output_dir={run}", "train.max_steps=4",
                 "train.resume_from_checkpoint=true"])
    assert code == 2
    assert f"'{run / 'training_curves.png'}' is a symlink to {weights}" in one_error_line(capsys.readouterr().err)
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == digest
    assert not (run / "checkpoint-4").exists()


@pytest.mark.parametrize("command", ["eval", "distill"])
def test_the_commands_writing_into_a_run_check_their_names_too(tiny_run, tmp_path, capsys, command):
    run = tmp_path / "out"
    shutil.copytree(tiny_run, run, symlinks=True)
    name = "eval" if command == "eval" else "distill"
    (run / name).symlink_to(run / "checkpoint-2")  # its logs would land among the checkpoint's files
    recipe = str(tiny_run.parent / "tiny.yaml")
    argv = ["eval", str(run / "checkpoint-2"), "--recipe", recipe] if command == "eval" else ["distill", recipe]
    assert main([*argv, f"train.output_dir={run}"]) == 2
    assert f"'{run / name}' is a symlink to {run / 'checkpoint-2'}" in one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in (run / "checkpoint-2").iterdir()) == sorted(p.name for p in (tiny_run / "checkpoint-2").iterdir())
