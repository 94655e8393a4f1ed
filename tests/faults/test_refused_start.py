"""A start refused before its first step leaves the folder as it found it, whatever it had written by then.

Before: a run refused for disk space had written its identity, recipe copy, tokenizer folder and data cache
into ``train.output_dir`` (often a folder it had just created), and left them there. In-process; the free
space is what ``shutil.disk_usage`` reports, replaced here.
"""

from __future__ import annotations

import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from neutrain.cli import main as neutrain
from neutrain.config import load_recipe
from neutrain.storage.run_dir import write_identity
from neutrain.trainer.ownership import identity_recipe
from tests.helpers import one_error_line, write_recipe

_Usage = namedtuple("_Usage", "total used free")

# What a run writes at its start, before the disk check: each must be gone after the refusal.
WRITTEN_AT_START = {"identity": ".neutrain-run", "lock": ".neutrain.lock", "recipe copy": "recipe.yaml",
                    "tokenizer folder": "tokenizer", "data cache": ".cache"}
# Written once training logs (never before the check); named so that a start writing it early is caught too.
WRITTEN_LATER = {"metrics": "metrics.jsonl", "curves": "training_curves.png", "summary": "summary.json"}


def _user_file(out: Path, recipe: Path) -> None:
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("the user's")  # refused as a folder no run wrote: nothing written at all


def _run_that_saved_nothing(out: Path, recipe: Path) -> None:
    out.mkdir(parents=True)
    write_identity(out, identity_recipe(load_recipe(str(recipe))))  # its identity is kept byte for byte


STATES = {  # the folder before the start -> how to make it (None: absent, and its parent too)
    "absent-with-its-parent": None,
    "empty": lambda out, recipe: out.mkdir(parents=True),
    "a-run-that-saved-nothing": _run_that_saved_nothing,
    "a-user-folder": _user_file,
}


def _tree(root: Path) -> dict[str, bytes | str] | None:
    if not root.exists():
        return None
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else "dir") for p in sorted(root.rglob("*"))}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("state", STATES)
def test_a_start_refused_for_disk_space_leaves_the_folder_as_it_found_it(tmp_path, capsys, monkeypatch, state):
    import neutrain.trainer.disk_plan as disk_plan

    out = tmp_path / "parent" / "out"
    recipe = write_recipe(tmp_path, train={"output_dir": str(out), "max_steps": 2, "save_steps": 1},
                          eval={"perplexity": False}, export={"format": "none"})
    if STATES[state] is not None:
        STATES[state](out, recipe)
    before = _tree(tmp_path / "parent")
    real_usage, real_check, seen = shutil.disk_usage, disk_plan.check_disk_space, []
    monkeypatch.setattr(shutil, "disk_usage", lambda p: _Usage(real_usage(p).total, real_usage(p).total - 4096, 4096))

    def check(*args, **kwargs):
        seen.extend(os.listdir(out))  # what the start had written when the disk check refused it
        return real_check(*args, **kwargs)

    monkeypatch.setattr(disk_plan, "check_disk_space", check)
    assert neutrain(["train", str(recipe)]) == 2
    line = one_error_line(capsys.readouterr().err)
    if state == "a-user-folder":
        assert "is not empty and holds no neutrain run" in line, line
    else:
        assert "free" in line and "this run needs" in line, line
        assert set(WRITTEN_AT_START.values()) <= set(seen), seen  # each kind was there to take back
    after = _tree(tmp_path / "parent")
    left = {kind: name for kind, name in {**WRITTEN_AT_START, **WRITTEN_LATER}.items()
            if (out / name).exists() and (before is None or f"out/{name}" not in before)}
    assert left == {}
    assert after == before


def test_a_rebuilt_tokenizer_folder_keeps_a_file_of_the_users_in_it_and_says_so(tmp_path):
    from neutrain.storage.run_lock import RunDirectoryError
    from neutrain.trainer.modeling import build_tokenizer

    def tokenizer(**model):
        recipe = load_recipe(str(write_recipe(tmp_path / "recipes", model=model, export={"format": "none"})))
        return build_tokenizer(recipe.model, recipe.data, str(out), str(out / ".cache"))

    out = tmp_path / "out"
    tokenizer(tokenizer="byte")
    (out / "tokenizer" / "notes.txt").write_text("the user's")
    with pytest.raises(RunDirectoryError, match=r"model.tokenizer: .* would delete '.*notes.txt' in it, not written "
                                                r"by the run: move it out"):
        tokenizer(tokenizer="train-bpe", tokenizer_vocab_size=300)
    assert (out / "tokenizer" / "notes.txt").read_text() == "the user's"
    assert (out / "tokenizer" / "tokenizer.json").exists()  # the old tokenizer, untouched


def test_eval_into_a_folder_that_is_no_run_is_refused_before_anything_is_written(tmp_path, capsys):
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")  # refused before it is loaded
    (checkpoint / "model.safetensors").write_bytes(b"")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's")
    recipe = write_recipe(tmp_path, train={"output_dir": str(folder)}, export={"format": "none"})
    before = _tree(folder)
    assert neutrain(["eval", str(checkpoint), "--recipe", str(recipe)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"train.output_dir '{folder}' is not empty and holds no neutrain run (notes.txt): nothing was written" in line
    assert _tree(folder) == before
