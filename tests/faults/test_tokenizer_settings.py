"""A tokenizer folder's settings that the library compares, indexes or renders are of the type it takes, checked by
the one check every user-named model or tokenizer folder passes before transformers reads it
(:func:`neutrain.files.check_folder`): ``model_max_length: "x"`` loaded and then ended ``generate`` in a
``TypeError`` traceback at the first prompt; each bad setting is now one line naming the folder, the file and the
key, at a recipe's load for ``model.tokenizer`` and at a command's load of a model folder."""

from __future__ import annotations

import json

import pytest

from neutrain.cli import main
from neutrain.config.validate import load_recipe
from neutrain.errors import RecipeError
from neutrain.files import TOKENIZER_SETTINGS_FILES, check_folder
from tests.helpers import tiny_hf_folder, write_recipe

# Each key the check holds to a type, with values of other types, and values it takes.
BAD = {
    "model_max_length": ["x", None, True, 0, -5, 2.5e-3, [512], {"n": 512}],
    "padding_side": ["up", None, 1, ["left"]],
    "truncation_side": ["middle", 0],
    "chat_template": [5, True, ["{{ x }}"], [{"name": 5, "template": "x"}], {"template": "x"}],
    "bos_token": [5, ["<s>"], {"content": 5}, True],
    "eos_token": [0, [1]],
    "pad_token": [1.5],
    "unk_token": [{"id": 3}],
    "additional_special_tokens": ["<x>", [5], {"content": "<x>"}],
    "added_tokens_decoder": [{"x": {"content": "<x>"}}, {"1": 5}, {"1": {"content": 5}}, ["<x>"], {"٣": {"content": "a"}}],
    "add_bos_token": ["yes", 1],
    "clean_up_tokenization_spaces": ["false"],
}
GOOD = {"model_max_length": [10 ** 30, 2048, 1e30], "padding_side": ["left", "right"], "chat_template": [
    None, "{{ messages }}", [{"name": "default", "template": "{{ x }}"}]], "bos_token": [None, "<s>", {"content": "<s>"}],
    "additional_special_tokens": [[], ["<x>", {"content": "<y>"}]], "added_tokens_decoder": [{"0": {"content": "<s>"}}],
    "add_bos_token": [True, None]}


def _with(folder, file: str, key: str, value) -> None:
    path = folder / file
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_hf_folder(tmp_path_factory.mktemp("tok") / "model")


@pytest.mark.parametrize("file", TOKENIZER_SETTINGS_FILES)
@pytest.mark.parametrize("key", sorted(BAD))
def test_every_setting_of_a_wrong_type_is_one_line_naming_the_file_and_key(folder, tmp_path, file, key):
    import shutil

    for value in BAD[key]:
        copy = tmp_path / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(folder, copy)
        _with(copy, file, key, value)
        with pytest.raises(ValueError) as caught:
            check_folder(copy, "model 'copy'", ValueError)
        line = str(caught.value)
        assert "\n" not in line and line.startswith(f"model 'copy': {file}: '{key}' is "), (value, line)


def test_the_settings_real_tokenizers_write_are_taken(folder, tmp_path):
    import shutil

    for key, values in GOOD.items():
        for value in values:
            copy = tmp_path / "copy"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(folder, copy)
            _with(copy, "tokenizer_config.json", key, value)
            check_folder(copy, "model 'copy'", ValueError)


def test_a_recipe_and_generate_refuse_a_bad_setting_before_transformers_reads_it(folder, tmp_path, capsys):
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    _with(copy, "tokenizer_config.json", "model_max_length", "x")
    recipe = write_recipe(tmp_path, model={"tokenizer": str(copy)})
    with pytest.raises(RecipeError, match=r"^model\.tokenizer: .*tokenizer_config\.json: 'model_max_length' is 'x'"):
        load_recipe(recipe, shape_only=True)
    assert main(["generate", str(copy), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "tokenizer_config.json: 'model_max_length' is 'x'" in err, err
