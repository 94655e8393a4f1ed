"""A path or setting that is no UTF-8 text is refused where it comes in, naming its key or argument.

A byte that is not UTF-8 in a file name (``$'/tmp/run\\xff'`` on the command line) reaches Python as a lone
surrogate. The file system takes it back, so every check of the path passed, but the tokenizer's writer, the
JSON records and the YAML recipe beside the checkpoints do not: ``export --output`` and ``train.output_dir``
ended in a ``UnicodeEncodeError`` traceback after the model was loaded. The tables cover every string-valued
recipe key and every path argument of every command.
"""

from __future__ import annotations

import copy

import pytest

from neutrain.cli import main
from neutrain.config import RecipeError, validate_recipe
from neutrain.config.schema import DATASET_KEYS, SCHEMA
from tests.helpers import TINY_RECIPE, one_error_line

BAD = "ab\udcffc"
TEXT_KEYS = [(s, n) for s, keys in SCHEMA.items() for n, key in keys.items()
             if str in (key.type if isinstance(key.type, tuple) else (key.type,))]


@pytest.mark.parametrize("section,name", TEXT_KEYS, ids=[f"{s}.{n}" for s, n in TEXT_KEYS])
def test_every_text_key_refuses_what_is_not_text(tmp_path, section, name):
    raw = copy.deepcopy(TINY_RECIPE)
    raw["train"]["output_dir"] = str(tmp_path / "out")
    raw.setdefault(section, {})[name] = f"{tmp_path}/{BAD}"
    with pytest.raises(RecipeError) as info:
        validate_recipe(raw)
    assert str(info.value).startswith(f"{section}.{name}"), str(info.value)


@pytest.mark.parametrize("name", [n for n, key in DATASET_KEYS.items() if key.type is str])
def test_every_dataset_text_key_refuses_what_is_not_text(tmp_path, name):
    raw = copy.deepcopy(TINY_RECIPE)
    raw["train"]["output_dir"] = str(tmp_path / "out")
    raw["data"]["datasets"] = [{**raw["data"]["datasets"][0], name: f"{tmp_path}/{BAD}"}]
    with pytest.raises(RecipeError, match=r"^data\.datasets"):
        validate_recipe(raw)


COMMANDS = {
    "train recipe": ["train", "{bad}"],
    "estimate recipe": ["estimate", "{bad}"],
    "distill recipe": ["distill", "{bad}"],
    "eval target": ["eval", "{bad}"],
    "eval --recipe": ["eval", "{tmp}", "--recipe", "{bad}"],
    "export checkpoint": ["export", "{bad}"],
    "export --output": ["export", "{tmp}", "--output", "{bad}"],
    "export --base": ["export", "{tmp}", "--base", "{bad}"],
    "generate model": ["generate", "{bad}", "--prompt", "hi"],
    "generate --draft": ["generate", "{tmp}", "--draft", "{bad}", "--prompt", "hi"],
    "generate --input-file": ["generate", "{tmp}", "--input-file", "{bad}"],
}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_path_argument_refuses_what_is_not_text(tmp_path, capsys, name):
    argv = [a.format(bad=f"{tmp_path}/{BAD}", tmp=tmp_path) for a in COMMANDS[name]]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"neutrain: error: {name}: ") and "not UTF-8" in line, line
