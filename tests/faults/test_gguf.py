"""Bad GGUF inputs: one ``neutrain: error:`` line naming ``model.gguf_file``, exit 2, no traceback."""

from __future__ import annotations

import sys

import pytest

from neutrain.cli import main
from neutrain.config import RecipeError, load_recipe
from tests.helpers import write_recipe

GGUF_MODEL = {"init": "pretrained", "tokenizer": None, "config": None}


def _one_error_line(capsys, recipe) -> str:
    rc = main(["train", str(recipe)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("neutrain: error: "), err
    return lines[0]


def test_missing_or_misnamed_gguf_file_is_refused_before_loading(tmp_path):
    with pytest.raises(RecipeError, match=r"model\.gguf_file: '.*absent\.gguf' does not exist"):
        load_recipe(write_recipe(tmp_path, model={**GGUF_MODEL, "gguf_file": str(tmp_path / "absent.gguf")}))
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(RecipeError, match=r"model\.gguf_file: '.*weights\.bin' is not a \.gguf file"):
        load_recipe(write_recipe(tmp_path, model={**GGUF_MODEL, "gguf_file": str(tmp_path / "weights.bin")}))
    with pytest.raises(RecipeError, match=r"model\.gguf_file: 'other\.gguf' is not in model\.base_model"):
        load_recipe(write_recipe(tmp_path, model={**GGUF_MODEL, "base_model": str(tmp_path), "gguf_file": "other.gguf"}))


def test_a_file_that_is_not_gguf_is_one_line_naming_the_key(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a GGUF" * 8)
    line = _one_error_line(capsys, write_recipe(tmp_path, model={**GGUF_MODEL, "gguf_file": str(bad)}))
    assert "model.gguf_file" in line and "model.gguf" in line, line


def test_missing_gguf_package_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    line = _one_error_line(capsys, write_recipe(tmp_path, model={**GGUF_MODEL, "gguf_file": str(bad)}))
    assert "model.gguf_file" in line and "pip install gguf" in line, line
