"""Resuming a checkpoint with a recipe that changed what it was trained with, and a stale saved tokenizer.

Before: a dense checkpoint resumed with ``memory.weights:
neuzip-lossless`` used to log "resuming at step 2" and exit 0 with its trained weights
dropped; a different hidden size, layer count or optimizer gave a traceback; a different
tokenizer or dataset was accepted without a word. Now each is one line, exit 2, naming the
key and both values, before anything trains (a switch between dense and NeuZip lossless in
one dtype resumes: tests/integration/test_weights_switch.py). Tiny CPU runs, in-process.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from neutrain.cli import main as neutrain
from neutrain.config import load_recipe
from tests.helpers import write_recipe

QUIET = {"export": {"format": "none"}, "eval": {"perplexity": False}}


def _tree(root: Path) -> dict[str, str]:
    """Every file of the run by path -> sha256, but the data cache (a different dataset adds its own entry)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.parts[len(root.parts)] != ".cache"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 2-step dense run (byte tokenizer, adalomo: compressed weights need a fused optimizer) with its checkpoint-2."""
    directory = tmp_path_factory.mktemp("trained")
    recipe = write_recipe(directory, train={"max_steps": 2, "save_steps": 2, "optimizer": "adalomo"}, **QUIET)
    assert neutrain(["train", str(recipe)]) == 0
    return directory


def _resume_copy(trained: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(trained / "out", out)
    return out


# A switch between dense and NeuZip lossless is no longer among these: it resumes bit for bit
# (tests/integration/test_weights_switch.py); lossy weights are refused (below).
@pytest.mark.parametrize("change, key, old, new", [
    ({"model": {"config": {"hidden_size": 64}}}, "model.config.hidden_size", "32", "64"),
    ({"model": {"config": {"num_hidden_layers": 3}}}, "model.config.num_hidden_layers", "2", "3"),
    ({"train": {"optimizer": "lomo"}}, "train.optimizer", "adalomo", "lomo"),
    ({"model": {"tokenizer": "train-bpe", "tokenizer_vocab_size": 300}}, "model.tokenizer", "'byte'", "'train-bpe'"),
    ({"data": {"datasets": [{"path": "python-stdlib", "type": "text", "max_files": 5}]}}, "data.datasets[0].max_files",
     "6", "5"),
])
def test_a_resume_that_changes_what_the_checkpoint_was_trained_with_is_one_line(trained, tmp_path, capsys, change, key, old, new):
    out = _resume_copy(trained, tmp_path)
    before = _tree(out)
    sections = {**QUIET, "train": {"max_steps": 4, "save_steps": 2, "optimizer": "adalomo", "resume_from_checkpoint": True}}
    for section, values in change.items():
        if section == "model" and "config" in values:  # a change of one config entry keeps the others
            values = {"config": {**load_recipe(str(trained / "tiny.yaml")).model.config, **values["config"]}}
        sections[section] = {**sections.get(section, {}), **values}
    recipe = write_recipe(tmp_path / "changed", **sections)
    capsys.readouterr()
    assert neutrain(["train", str(recipe), f"train.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("neutrain: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    err = errors[0]
    assert f"{key}={old}" in err and f"{key}={new}" in err, err
    assert _tree(out) == before  # nothing trained, saved or rewritten


def test_a_checkpoint_without_a_run_record_is_compared_on_its_weights_format(trained, tmp_path):
    """An older checkpoint has no neutrain_run.json: its weights format and config.json still speak."""
    from neutrain.trainer.resume_check import RUN_RECORD, ResumeMismatchError, check_resume, saved_record

    checkpoint = _resume_copy(trained, tmp_path) / "checkpoint-2"
    record = saved_record(checkpoint)
    assert record["memory.weights"] == "dense" and record["model.config.hidden_size"] == 32
    assert record["train.optimizer"] == "adalomo" and "model.tokenizer" in record
    check_resume(checkpoint, {**record, "train.optimizer": "lomo"}, reset_optimizer=True)  # its state starts afresh
    with pytest.raises(ResumeMismatchError, match="train.optimizer=adalomo, this recipe has train.optimizer=lomo"):
        check_resume(checkpoint, {**record, "train.optimizer": "lomo"})
    (checkpoint / RUN_RECORD).unlink()
    legacy = saved_record(checkpoint)
    assert legacy["memory.weights"] == "dense" and legacy["model.config.num_hidden_layers"] == 2
    assert "train.optimizer" not in legacy
    check_resume(checkpoint, {**record, "train.optimizer": "lomo"})  # not recorded: nothing to compare
    with pytest.raises(ResumeMismatchError, match="memory.weights=dense, this recipe has memory.weights=neuzip-lossy-3"):
        check_resume(checkpoint, {**record, "memory.weights": "neuzip-lossy-3"})
    # Dense and NeuZip lossless hold the same values: a switch resumes where the dtype is the same (an older
    # checkpoint does not record it: the weights reader compares the tensors' own dtypes).
    check_resume(checkpoint, {**record, "memory.weights": "neuzip-lossless"})
    check_resume(trained / "out" / "checkpoint-2", {**record, "memory.weights": "neuzip-lossless"})
    with pytest.raises(ResumeMismatchError, match=r"memory.weights=dense \(float32 weights\), this recipe has "
                                                  r"memory.weights=neuzip-lossless \(bfloat16 weights\)"):
        check_resume(trained / "out" / "checkpoint-2",
                     {**record, "memory.weights": "neuzip-lossless", "model.weights_dtype": "bfloat16"})


# ---- failure 5: a stale tokenizer in <output_dir>/tokenizer -------------------------------------------


def _tokenizer(tmp_path: Path, out: Path, **model):
    from neutrain.trainer.modeling import build_tokenizer

    recipe = load_recipe(str(write_recipe(tmp_path / "recipes", model=model, **QUIET)))
    return build_tokenizer(recipe.model, recipe.data, str(out), str(out / ".cache"))


def test_a_saved_tokenizer_built_for_another_recipe_is_rebuilt_or_refused(tmp_path, caplog):
    out = tmp_path / "out"
    byte = _tokenizer(tmp_path, out, tokenizer="byte")
    bpe = _tokenizer(tmp_path, out, tokenizer="train-bpe", tokenizer_vocab_size=300)
    assert len(bpe) != len(byte)  # the byte tokenizer saved in out/tokenizer used to come back
    assert "model.tokenizer='byte', this recipe has 'train-bpe': rebuilt" in caplog.text
    reloaded = _tokenizer(tmp_path, out, tokenizer="train-bpe", tokenizer_vocab_size=300)
    assert reloaded.get_vocab() == bpe.get_vocab()  # the same recipe reuses it
    saved = json.loads((out / "tokenizer" / "neutrain_tokenizer.json").read_text())
    assert saved["model.tokenizer"] == "train-bpe" and saved["model.tokenizer_vocab_size"] == 300
    (out / "checkpoint-2").mkdir()  # now a checkpoint was trained with it: rebuilding would orphan it
    from neutrain.errors import RecipeError

    with pytest.raises(RecipeError, match=r"model.tokenizer_vocab_size: .* was built with "
                                          r"model.tokenizer_vocab_size=300 .*checkpoint-2.* has model.tokenizer_vocab_size=400"):
        _tokenizer(tmp_path, out, tokenizer="train-bpe", tokenizer_vocab_size=400)
