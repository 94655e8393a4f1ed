"""A tokenizer folder the library cannot load is one line that says which file and what in it.

The load's failure was reported by its exception's class alone: "(JSONDecodeError)", "(AttributeError)",
"(KeyError)", "(Exception)", naming neither the file nor the place. The folder's JSON files now go through the
guarded reader when the load fails (file, line and column; an object expected), and any other failure keeps
the library's own words on the line. The table breaks each JSON file of a tokenizer folder in each way.
"""

from __future__ import annotations

import json

import pytest

from neutrain.cli import main
from tests.helpers import one_error_line, write_recipe


def _break(folder, file: str, how: str) -> None:
    path = folder / file
    if how == "not JSON":
        path.write_text("{bad")
    elif how == "a list":
        path.write_text("[1, 2]")
    elif how == "NaN":
        path.write_text('{"a": NaN}')
    elif how == "vocabulary id":
        data = json.loads(path.read_text())
        data["model"]["vocab"] = {"a": -5}
        path.write_text(json.dumps(data))


CASES = [(f, how, said) for f in ("tokenizer.json", "tokenizer_config.json")
         for how, said in (("not JSON", "is not valid JSON (Expecting property name enclosed in double quotes at line 1, "
                                        "column 2)"),
                           ("a list", "holds a JSON list, expected an object"))] + \
        [("tokenizer.json", "NaN", "holds NaN (line 1)"), ("tokenizer.json", "vocabulary id", "(Exception: ")]


def _folder(tmp_path, file: str, how: str):
    from neutrain.data import byte_tokenizer

    folder = tmp_path / "tok"
    byte_tokenizer().save_pretrained(folder)
    if file == "tokenizer.json" and how == "vocabulary id":
        data = json.loads((folder / file).read_text())
        if not isinstance(data.get("model", {}).get("vocab"), dict):
            pytest.skip("the byte tokenizer has no vocabulary mapping to break")
    _break(folder, file, how)
    return folder


@pytest.mark.parametrize("file,how,said", CASES, ids=[f"{f}: {h}" for f, h, _ in CASES])
def test_a_broken_tokenizer_file_is_named(tmp_path, file, how, said):
    from neutrain.errors import RecipeError
    from neutrain.nn.formats import load_named_tokenizer

    folder = _folder(tmp_path, file, how)
    with pytest.raises(RecipeError) as info:
        load_named_tokenizer(str(folder))
    message = str(info.value)
    assert message.startswith("model.tokenizer: ") and said in message and "\n" not in message, message
    if how != "vocabulary id":
        assert f"file '{folder / file}'" in message, message


def test_train_says_it_in_one_line(tmp_path, capsys):
    folder = _folder(tmp_path, "tokenizer_config.json", "not JSON")
    recipe = write_recipe(tmp_path, train={"max_steps": 1})
    assert main(["train", str(recipe), f"model.tokenizer={folder}"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"neutrain: error: model.tokenizer: file '{folder / 'tokenizer_config.json'}' is not valid "
                           "JSON"), line
