"""A sharded ``model.safetensors.index.json`` never leads a load outside its model directory.

A foreign export's index could map weights to ``../..`` or absolute paths: ``generate``, ``export`` and
``eval`` followed it, and ``export`` copied the safetensors file it found there into a new export with a
valid manifest. Every command that loads a model directory, and both build paths of ``neutrain train``
(dense through transformers, compressed through neutrain's loader), must refuse it before reading a shard.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from neutrain.cli import main as neutrain
from tests.helpers import TINY_LLAMA, one_error_line, write_recipe


def _foreign_export(tmp_path: Path, absolute: bool) -> tuple[Path, Path]:
    """A two-shard HF export whose index points one shard outside it; returns (export, the file outside)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from neutrain.data import byte_tokenizer

    tokenizer = byte_tokenizer()
    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=len(tokenizer))
    torch.manual_seed(0)
    export = tmp_path / "foreign"
    LlamaForCausalLM(config).save_pretrained(export, max_shard_size="40KB")
    tokenizer.save_pretrained(export)
    index_path = export / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    outside = elsewhere / shard
    shutil.move(export / shard, outside)  # any safetensors file on disk, e.g. another user's model
    where = str(outside) if absolute else f"../elsewhere/{shard}"
    index["weight_map"] = {name: where if file == shard else file for name, file in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    return export, outside


@pytest.mark.parametrize("absolute", [False, True], ids=["dotdot", "absolute"])
def test_every_command_refuses_an_index_that_points_outside_the_model_directory(tmp_path, capsys, absolute):
    export, outside = _foreign_export(tmp_path, absolute)
    recipe = write_recipe(tmp_path, export={"format": "none"}, eval={"perplexity": True})
    as_base = ["model.init=pretrained", "model.config=null", f"model.base_model={export}"]
    commands = {
        "export": ["export", str(export), "--output", str(tmp_path / "copied")],
        "generate": ["generate", str(export), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"],
        "eval": ["eval", str(export), "--recipe", str(recipe)],
        "train (dense)": ["train", str(recipe), *as_base],
        "train (neuzip)": ["train", str(recipe), *as_base, "memory.weights=neuzip-lossless", "train.optimizer=adalomo"],
    }
    for what, command in commands.items():
        capsys.readouterr()
        assert neutrain(command) == 2, what
        line = one_error_line(capsys.readouterr().err)
        assert "model.safetensors.index.json' maps tensor" in line and "leads outside" in line, (what, line)
    assert not (tmp_path / "copied").exists()
    assert not (tmp_path / "out" / "checkpoint-4").exists()
