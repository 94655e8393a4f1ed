"""Every tensor of a model file lands in a parameter, and every parameter gets a tensor.

Why: a safetensors tensor that matched no parameter of the model was skipped in silence (only the rotary tables
of old checkpoints were meant), so a file holding another architecture's or renamed weights loaded without
them, exit 0. Each case of the class, over the ways a name can miss (another architecture's, a misspelt
layer, an extra weight, a parameter left out), is one line naming the file and the tensor, exit 2; the tensors a
model computes itself (a rotary ``inv_freq``, GPT-2's mask buffers) are skipped with a warning naming them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.helpers import one_error_line, tiny_hf_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_hf_folder(tmp_path_factory.mktemp("tiny"))


def _edited(folder: Path, tmp_path: Path, edit) -> Path:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    tensors = load_file(copy / "model.safetensors")
    edit(tensors, torch)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def _generate(model: Path) -> int:
    from neutrain.cli import main

    return main(["generate", str(model), "--prompt", "hi", "--max-new-tokens", "1", "--raw", "--device", "cpu"])


CASES = {  # name -> (edit, the tensor the line names)
    "another architecture's tensor": (lambda t, torch: t.update({"transformer.h.0.attn.c_attn.weight": torch.zeros(4)}),
                                      "transformer.h.0.attn.c_attn.weight"),
    "an extra weight in a layer": (lambda t, torch: t.update({"model.layers.0.mlp.gate.weight": torch.zeros(4)}),
                                   "model.layers.0.mlp.gate.weight"),
    "a layer past the config's": (lambda t, torch: t.update({"model.layers.9.input_layernorm.weight": torch.ones(4)}),
                                  "model.layers.9.input_layernorm.weight"),
    "a misspelt name": (lambda t, torch: t.update({"model.nrom.weight": t.pop("model.norm.weight")}),
                        "model.nrom.weight"),
    "a parameter with no tensor": (lambda t, torch: t.pop("model.layers.0.post_attention_layernorm.weight"),
                                   "model.layers.0.post_attention_layernorm.weight"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_tensor_matching_no_parameter_or_a_parameter_with_none_is_refused_naming_it(folder, tmp_path, capsys, case):
    edit, named = CASES[case]
    model = _edited(folder, tmp_path, edit)
    assert _generate(model) == 2
    line = one_error_line(capsys.readouterr().err)
    assert named in line and "model" in line, line


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.rotary_emb.inv_freq", "model.rotary_emb.inv_freq"])
def test_a_tensor_the_model_computes_itself_is_skipped_with_a_warning_naming_it(folder, tmp_path, capsys, caplog, name):
    model = _edited(folder, tmp_path, lambda t, torch: t.update({name: torch.ones(4)}))
    with caplog.at_level(logging.WARNING, logger="neutrain"):
        assert _generate(model) == 0, capsys.readouterr().err
    assert name in caplog.text
