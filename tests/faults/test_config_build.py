"""A model config that every rule lets through but the architecture's own code cannot build is one line.

Before: ``head_dim: 0`` (a size where 0 means "derived" for some architectures, not for Llama) passed every
check, then ended in Llama's own ``ZeroDivisionError`` traceback, from ``train``'s build and from loading a model whose
``config.json`` held them. Every config the build or the memory plan uses is built in one place, which names
the config (the recipe's key, or the file) and keeps the architecture's own words.
"""

from __future__ import annotations

import json

import pytest

from neutrain.cli import main
from tests.helpers import TINY_LLAMA, one_error_line, write_recipe

UNBUILDABLE = {
    "a head of width 0": {"head_dim": 0},
    "a head of width 0, scaled rotary": {"head_dim": 0, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                          "rope_theta": 10000.0}},
}


@pytest.mark.parametrize("case", UNBUILDABLE)
def test_a_recipe_config_the_architecture_cannot_build_is_one_line(tmp_path, capsys, case):
    recipe = write_recipe(tmp_path, model={"config": {**TINY_LLAMA, **UNBUILDABLE[case]}})
    assert main(["train", str(recipe)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "model.config: the llama architecture cannot be built" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", UNBUILDABLE)
def test_a_model_file_whose_config_cannot_be_built_is_named(tmp_path, capsys, case):
    from transformers import LlamaConfig, LlamaForCausalLM

    from neutrain.data import byte_tokenizer

    tok = byte_tokenizer()
    folder = tmp_path / "model"
    config = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), **config)).save_pretrained(folder)
    tok.save_pretrained(folder)
    values = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**values, **UNBUILDABLE[case]}))
    assert main(["generate", str(folder), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "config" in line and "cannot be built" in line, line


@pytest.mark.parametrize("case", UNBUILDABLE)
def test_estimate_refuses_a_config_the_build_would_refuse(tmp_path, capsys, case):
    # The planner reads the model's size from the same skeleton the build makes: a config it cannot build is the
    # build's refusal, not a closed-form estimate of a model that will never exist (exit 0 before).
    recipe = write_recipe(tmp_path, model={"config": {**TINY_LLAMA, **UNBUILDABLE[case]}})
    assert main(["estimate", str(recipe)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "model.config: the llama architecture cannot be built" in line, line
