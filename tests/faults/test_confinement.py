"""Nothing read or written outside the run or checkpoint directory.

Before: ``summary.json``, ``metrics.jsonl`` and ``training_curves.png`` were
written through symlinks pointing outside the run directory; a manifest entry such as
``../../secret`` or an absolute path was read (a size and hash oracle for any readable
file); a ``model.safetensors`` symlinked outside its checkpoint was loaded silently. Each
is now refused in one line, exit 2, before anything is read or written through it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from neutrain.cli import main as neutrain
from tests.helpers import write_recipe

QUIET = {"export": {"format": "none"}, "eval": {"perplexity": False}}


def _error(capsys) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("neutrain: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """checkpoint-2 of a 2-step dense run, made once for the module."""
    directory = tmp_path_factory.mktemp("trained")
    assert neutrain(["train", str(write_recipe(directory, train={"max_steps": 2, "save_steps": 2}, **QUIET))]) == 0
    return directory / "out" / "checkpoint-2"


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", "training_curves.png"])
def test_a_run_output_symlinked_outside_the_run_directory_is_refused(tmp_path, capsys, name):
    recipe = write_recipe(tmp_path, train={"max_steps": 1, "save_steps": 1}, **QUIET)
    out, outside = tmp_path / "out", tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    outside.write_bytes(b"not the run's")
    out.mkdir()
    (out / name).symlink_to(outside)
    assert neutrain(["train", str(recipe)]) == 2
    error = _error(capsys)
    assert f"'{out / name}' is a symlink to {outside}, outside the run directory" in error, error
    assert outside.read_bytes() == b"not the run's"
    assert not list(out.glob("checkpoint-*"))  # refused before training


def test_eval_refuses_an_eval_directory_symlinked_outside_the_run(checkpoint, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(checkpoint.parent, run)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (run / "eval").symlink_to(outside)
    assert neutrain(["eval", str(checkpoint.parent.parent / "tiny.yaml"), f"train.output_dir={run}"]) == 2
    assert f"'{run / 'eval'}' is a symlink to {outside}, outside the run directory" in _error(capsys)
    assert not list(outside.iterdir())


def test_a_symlink_that_stays_inside_the_run_directory_is_followed(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 1, "save_steps": 1}, **QUIET)
    out = tmp_path / "out"
    assert neutrain(["train", str(recipe)]) == 0
    # The user moves the run's log into a subfolder and links it back; the continued run writes through the link.
    (out / "logs").mkdir()
    (out / "metrics.jsonl").rename(out / "logs" / "metrics.jsonl")
    (out / "metrics.jsonl").symlink_to(out / "logs" / "metrics.jsonl")
    assert neutrain(["train", str(recipe), "train.max_steps=2", "train.resume_from_checkpoint=true"]) == 0
    steps = [json.loads(line)["step"] for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 1 and 2 in steps


def _forge_entry(checkpoint: Path, rel: str, target: Path) -> None:
    """List ``rel`` in the manifest with ``target``'s true size and sha256, as a prober would."""
    manifest = checkpoint / "neutrain_manifest.json"
    data = json.loads(manifest.read_text())
    data["files"][rel] = {"size": target.stat().st_size, "sha256": hashlib.sha256(target.read_bytes()).hexdigest()}
    manifest.write_text(json.dumps(data))


@pytest.mark.parametrize("absolute", [False, True])
def test_a_manifest_entry_leaving_the_checkpoint_is_never_read(checkpoint, tmp_path, capsys, absolute):
    copy = tmp_path / "run" / "checkpoint-2"
    shutil.copytree(checkpoint, copy)
    secret = tmp_path / "secret.txt"
    secret.write_text("a file of someone else's")
    rel = str(secret) if absolute else os.path.relpath(secret, copy)
    assert rel.startswith("/" if absolute else "../")
    _forge_entry(copy, rel, secret)
    assert neutrain(["export", str(copy), "--output", str(tmp_path / "export")]) == 2
    error = _error(capsys)
    assert f"'{rel}' leaves {copy} (a '..' or an absolute path): refused" in error, error
    assert not (tmp_path / "export").exists()


def test_a_checkpoint_file_symlinked_outside_the_checkpoint_is_refused(checkpoint, tmp_path, capsys):
    copy = tmp_path / "run" / "checkpoint-2"
    shutil.copytree(checkpoint, copy)
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(copy / "model.safetensors", outside)  # the very bytes the manifest lists: only the link is wrong
    (copy / "model.safetensors").symlink_to(outside)
    assert neutrain(["export", str(copy), "--output", str(tmp_path / "export")]) == 2
    error = _error(capsys)
    assert f"'{copy / 'model.safetensors'}' is a symlink to {outside}, outside the checkpoint" in error, error
    recipe = write_recipe(tmp_path / "resume", train={"max_steps": 4, "save_steps": 2, "resume_from_checkpoint": str(copy)},
                          **QUIET)
    assert neutrain(["train", str(recipe)]) == 2
    assert "is a symlink to" in _error(capsys)
    assert not (tmp_path / "resume" / "out" / "checkpoint-4").exists()
