"""A file the user put inside a folder a run wrote is never deleted with that folder.

Why: an overwrite, the checkpoint rotation and an ``export --overwrite`` deleted whole folders the run had
listed (``checkpoint-N``, ``tokenizer/``, ``eval/``, ``export/``), and with them the notes a user had put
inside: ``train.overwrite_output_dir`` of a finished run took ``checkpoint-2/mynotes.txt`` and
``tokenizer/sub/x`` with exit 0. Inside a model folder neutrain's files are those its manifest lists; in the
folders without one, the names neutrain writes there. A folder holding anything else is refused (overwrite,
export) or kept (rotation), the file named.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import finished_run, one_error_line


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    from neutrain.cli import main

    out = finished_run(tmp_path_factory.mktemp("run"), train={"max_steps": 4, "save_steps": 2},
                       eval={"perplexity": True, "max_eval_samples": 2})
    assert main(["eval", str(out.parent / "tiny.yaml")]) == 0  # the run's eval/
    assert (out / "eval").is_dir()
    return out


def _copy(template: Path, tmp_path: Path) -> Path:
    shutil.copytree(template.parent, tmp_path / "run")
    recipe = tmp_path / "run" / "tiny.yaml"
    recipe.write_text(recipe.read_text().replace(str(template.parent), str(tmp_path / "run")))
    return tmp_path / "run" / "out"


PLACES = ["checkpoint-2/mynotes.txt", "checkpoint-4/sub/notes.md", "tokenizer/mynotes.txt", "tokenizer/sub/x",
          "export/mynotes.txt", "eval/mine/notes.txt"]


@pytest.mark.parametrize("place", PLACES)
def test_an_overwrite_refuses_a_folder_holding_a_file_the_run_did_not_write(template, tmp_path, capsys, place):
    from neutrain.cli import main

    out = _copy(template, tmp_path)
    planted = out / place
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_text("the user's")
    assert main(["train", str(out.parent / "tiny.yaml"), "train.overwrite_output_dir=true", "train.seed=3"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(planted) in line, line
    assert planted.read_text() == "the user's" and (out / "checkpoint-2").is_dir()


def test_the_rotation_keeps_a_checkpoint_holding_a_file_the_run_did_not_write(template, tmp_path, caplog):
    from neutrain.cli import main

    out = _copy(template, tmp_path)
    (out / "checkpoint-2" / "mynotes.txt").write_text("the user's")
    assert main(["train", str(out.parent / "tiny.yaml"), "train.resume_from_checkpoint=true", "train.max_steps=8",
                 "train.save_total_limit=1"]) == 0
    assert (out / "checkpoint-2" / "mynotes.txt").read_text() == "the user's"
    assert not (out / "checkpoint-4").exists() and (out / "checkpoint-8").is_dir()
    assert "mynotes.txt" in caplog.text


def test_an_export_overwrite_refuses_an_export_holding_a_file_it_did_not_write(template, tmp_path, capsys):
    from neutrain.cli import main

    out = _copy(template, tmp_path)
    (out / "export" / "mynotes.txt").write_text("the user's")
    assert main(["export", str(out / "checkpoint-4"), "--output", str(out / "export"), "--overwrite"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(out / "export" / "mynotes.txt") in line, line
    assert (out / "export" / "mynotes.txt").read_text() == "the user's"


def test_a_resume_that_would_save_a_checkpoint_again_refuses_when_it_holds_a_file_the_run_did_not_write(
        template, tmp_path, capsys):
    from neutrain.cli import main

    out = _copy(template, tmp_path)
    (out / "checkpoint-4" / "mynotes.txt").write_text("the user's")
    assert main(["train", str(out.parent / "tiny.yaml"), f"train.resume_from_checkpoint={out / 'checkpoint-2'}"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(out / "checkpoint-4" / "mynotes.txt") in line, line
    assert (out / "checkpoint-4" / "mynotes.txt").read_text() == "the user's"
