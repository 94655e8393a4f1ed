"""A command-line override of a string key is the text as typed: a path is never cut at a ``#`` or folded.

Parsed as YAML, ``'train.output_dir=w/runs/exp #2'`` became ``w/runs/exp`` (the rest read as a comment),
so ``train.overwrite_output_dir=true`` deleted the checkpoints of the run in ``w/runs/exp``; a newline
folded to a space. The destructive case runs a real training run in-process.
"""

from __future__ import annotations

import pytest

from neutrain.cli import main as neutrain
from neutrain.config import load_recipe
from tests.helpers import one_error_line, write_recipe

QUIET = {"export": {"format": "none"}, "eval": {"perplexity": False}}


def test_a_path_override_with_a_hash_is_taken_literally_and_another_runs_checkpoints_survive(tmp_path, capsys):
    recipe = write_recipe(tmp_path, train={"max_steps": 1, "save_steps": 1}, **QUIET)
    other = tmp_path / "exp"  # another run's directory, whose name is a prefix of the new one
    (other / "checkpoint-2").mkdir(parents=True)
    (other / "checkpoint-2" / "model.safetensors").write_bytes(b"the other run's weights")
    target = f"{tmp_path}/exp #2"
    assert neutrain(["train", str(recipe), f"train.output_dir={target}", "train.overwrite_output_dir=true"]) == 0
    assert (other / "checkpoint-2" / "model.safetensors").read_bytes() == b"the other run's weights"
    assert (tmp_path / "exp #2" / "checkpoint-1" / "model.safetensors").is_file()


@pytest.mark.parametrize("text, expected", [
    ("w/runs/exp #2", "w/runs/exp #2"),          # YAML would end the value at ' #'
    ("w/runs/a: b", "w/runs/a: b"),              # YAML would read a mapping
    ("w/runs/[draft]", "w/runs/[draft]"),        # YAML would read a list
    ("'w/runs/quoted'", "w/runs/quoted"),        # one quoted YAML string: its text
])
def test_string_overrides_are_the_text_as_typed(tmp_path, text, expected):
    recipe = write_recipe(tmp_path, **QUIET)
    assert load_recipe(recipe, [f"train.output_dir={text}"]).train.output_dir == expected
    assert load_recipe(recipe, [f"eval.sample_prompt={text}"]).eval.sample_prompt == expected
    # Other types still read as YAML: a boolean, a number, null where the key allows it.
    loaded = load_recipe(recipe, ["train.resume_from_checkpoint=false", "memory.device_budget_gib=12.5",
                                  "eval.sample_prompt=null"])
    assert loaded.train.resume_from_checkpoint is False and loaded.memory.device_budget_gib == 12.5
    assert loaded.eval.sample_prompt is None


@pytest.mark.parametrize("form", ["{}/runs/exp\n2", "{}/runs/exp\t2", " {}/runs/exp", "{}/runs/exp ", ""])
def test_a_path_with_a_control_character_or_surrounding_space_is_refused_in_one_line(tmp_path, capsys, form):
    recipe = write_recipe(tmp_path, **QUIET)
    text = form.format(tmp_path)
    assert neutrain(["train", str(recipe), f"train.output_dir={text}"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("neutrain: error: train.output_dir: ") and "taken as written" in line, line
    assert not (tmp_path / "runs").exists()
