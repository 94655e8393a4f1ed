"""Every path-valued recipe key is checked for what it names at load, whether or not the run reads it.

A key the chosen settings would not read was not checked at all: ``model.base_model=/dev/zero`` (or a FIFO,
or a folder of something else) beside ``model.init: random`` trained a random model under that name, and the
recipe kept beside the checkpoints named a path no one could load. A folder a command creates was followed
through its links: a ``train.output_dir`` left as a link to a missing path trained a whole run into the
link's target, a folder the user never named, and a loop of links failed without naming the key. The table
crosses every path-valued key with every kind of thing that is not what it needs.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

from neutrain.cli import main
from neutrain.config import RecipeError, validate_recipe
from tests.helpers import TINY_RECIPE, one_error_line, write_recipe

READ_KEYS = ["model.base_model", "model.tokenizer", "model.config", "model.gguf_file", "train.fsdp_config",
             "train.deepspeed", "train.resume_from_checkpoint"]
OUTPUT_KEYS = ["train.output_dir", "export.output_dir"]
BAD_KINDS = ["device", "fifo", "loop", "dangling link", "missing below a dangling link"]


def _make(tmp_path: Path, kind: str) -> str:
    if kind == "device":
        return "/dev/zero"
    if kind == "fifo":
        os.mkfifo(tmp_path / "pipe")
        return str(tmp_path / "pipe")
    if kind == "loop":
        os.symlink(tmp_path / "b", tmp_path / "a")
        os.symlink(tmp_path / "a", tmp_path / "b")
        return str(tmp_path / "a")
    if kind == "empty folder":
        (tmp_path / "empty").mkdir()
        return str(tmp_path / "empty")
    if kind == "folder of something else":
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "readme.txt").write_text("mine")
        return str(tmp_path / "notes")
    if kind == "regular file":
        (tmp_path / "file.json").write_text("{}")
        return str(tmp_path / "file.json")
    os.symlink(tmp_path / "gone", tmp_path / "link")
    return str(tmp_path / "link") + ("/run" if kind.startswith("missing below") else "")


def _recipe(tmp_path: Path, dotted: str, value: str) -> dict:
    raw = copy.deepcopy(TINY_RECIPE)
    raw["train"]["output_dir"] = str(tmp_path / "out")
    section, name = dotted.split(".")
    if dotted == "model.gguf_file":
        value = value if value.endswith(".gguf") else _gguf_named(value, tmp_path)
        raw["model"].update(init="pretrained", config=None)
    raw.setdefault(section, {})[name] = value
    return raw


def _gguf_named(value: str, tmp_path: Path) -> str:
    """The same kind of thing under a ``.gguf`` name (the key refuses any other name first)."""
    target = tmp_path / "model.gguf"
    if os.path.lexists(value):
        os.symlink(value, target)
    return str(target)


TABLE = [(k, kind) for k in READ_KEYS for kind in BAD_KINDS] + \
        [(k, kind) for k in OUTPUT_KEYS for kind in ("loop", "dangling link", "missing below a dangling link")] + \
        [("distill.target", kind) for kind in (*BAD_KINDS, "regular file")]  # read after training, checked at load


@pytest.mark.parametrize("key,kind", TABLE, ids=[f"{k}={kind}" for k, kind in TABLE])
def test_every_path_key_refuses_what_it_cannot_use_naming_itself(tmp_path, key, kind):
    with pytest.raises(RecipeError) as info:
        validate_recipe(_recipe(tmp_path, key, _make(tmp_path, kind)))
    message = str(info.value)
    assert message.startswith(key) and "\n" not in message, message
    assert not (tmp_path / "gone").exists()  # nothing created through the link


@pytest.mark.parametrize("kind", ["device", "fifo", "loop", "dangling link", "empty folder", "folder of something else",
                                  "regular file"])
def test_an_unread_base_model_is_still_a_model(tmp_path, capsys, kind):
    value = _make(tmp_path, kind)
    recipe = write_recipe(tmp_path / "r", train={"max_steps": 1})  # init: random, a config and a byte tokenizer
    assert main(["train", str(recipe), f"model.base_model={value}"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("neutrain: error: model.base_model: ") and f"'{value}'" in line, line
    assert not (tmp_path / "r" / "out").exists()


def test_output_folder_through_a_dangling_link_creates_nothing(tmp_path, capsys):
    link = _make(tmp_path, "dangling link")
    recipe = write_recipe(tmp_path / "r", train={"max_steps": 1, "output_dir": link})
    assert main(["train", str(recipe)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"neutrain: error: train.output_dir: '{link}' is a symbolic link to the missing path"), line
    assert not (tmp_path / "gone").exists()
