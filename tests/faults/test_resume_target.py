"""A ``train.resume_from_checkpoint`` that names a directory holding no checkpoint is refused before the model
is built and the data read: the Trainer used to find the missing weights only after both, with the training
header already printed."""

from __future__ import annotations

import pytest

from neutrain.cli import main
from tests.helpers import one_error_line, write_recipe


@pytest.mark.parametrize("contents", [{}, {"notes.txt": "mine"}, {"config.json": "{}"}], ids=["empty", "notes", "config"])
def test_a_directory_that_is_no_checkpoint_is_refused_before_training(tmp_path, capsys, contents):
    target = tmp_path / "not-a-checkpoint"
    target.mkdir()
    for name, text in contents.items():
        (target / name).write_text(text)
    recipe = write_recipe(tmp_path, train={"resume_from_checkpoint": str(target), "max_steps": 1})
    assert main(["train", str(recipe)]) == 2
    out, err = capsys.readouterr()
    assert "holds neither trainer_state.json nor model weights: it is not a checkpoint" in one_error_line(err)
    assert "== training" not in out + err
