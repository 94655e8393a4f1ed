"""A resume continues the run it began, or is refused saying what changed and what that means.

A changed seed, batch size, gradient accumulation or sequence length, an edited data file, or a data
cache cut short resumed with exit 0, no warning, and losses that differed from the uninterrupted run:
the data position (which rows the next step takes) depends on all of them. In-process runs.
"""

from __future__ import annotations

import json
import shutil

import pytest

from neutrain.cli import main as neutrain
from neutrain.trainer.callbacks import read_metrics
from tests.helpers import one_error_line, write_recipe

CHANGES = {
    "train.seed": ("train.seed=7", "train.seed=42, this recipe has train.seed=7"),
    "train.micro_batch_size": ("train.micro_batch_size=2", "train.micro_batch_size=4, this recipe has train.micro_batch_size=2"),
    "train.gradient_accumulation_steps": ("train.gradient_accumulation_steps=2", "train.gradient_accumulation_steps=1, "
                                          "this recipe has train.gradient_accumulation_steps=2"),
    "data.sequence_len": ("data.sequence_len=32", "data.sequence_len=64, this recipe has data.sequence_len=32"),
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A 4-step run (checkpoints 2 and 4) on the python-stdlib corpus and a JSON-lines file."""
    root = tmp_path_factory.mktemp("position")
    data = root / "notes.jsonl"
    data.write_text("".join(json.dumps({"text": f"note {i}: " + "abcdefgh " * (8 + i)}) + "\n" for i in range(24)))
    recipe = write_recipe(root, train={"max_steps": 4, "save_steps": 2, "lr_scheduler": "constant", "warmup_steps": 0},
                          data={"datasets": [{"path": "python-stdlib", "type": "text", "max_files": 6},
                                             {"path": str(data), "type": "text"}]},
                          export={"format": "none"}, eval={"perplexity": False})
    assert neutrain(["train", str(recipe)]) == 0
    return recipe, data, root / "out"


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


@pytest.mark.parametrize("key", list(CHANGES))
def test_a_resume_that_changes_the_data_position_is_refused_naming_the_key(uninterrupted, tmp_path, capsys, key):
    recipe, _, out = uninterrupted
    override, said = CHANGES[key]
    assert neutrain(["train", str(recipe), f"train.output_dir={tmp_path / 'resumed'}",
                     f"train.resume_from_checkpoint={out / 'checkpoint-2'}", override]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"it was trained with {said}" in line and "would not continue the run it began" in line, line
    assert not (tmp_path / "resumed" / "checkpoint-4").exists()


def test_an_edited_data_file_is_refused_and_a_cut_short_cache_is_rebuilt_to_the_same_losses(uninterrupted, tmp_path,
                                                                                            capsys):
    recipe, data, out = uninterrupted
    # The run, stopped after checkpoint-2: a copy without what came later.
    again = tmp_path / "again"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("checkpoint-4", "summary.json"))
    lines = (again / "metrics.jsonl").read_text().splitlines()
    (again / "metrics.jsonl").write_text("".join(f"{line}\n" for line in lines if json.loads(line).get("step", 0) <= 2))
    resume = ["train", str(recipe), f"train.output_dir={again}", "train.resume_from_checkpoint=true"]
    original = data.read_bytes()
    try:
        data.write_bytes(original.replace(b"note 3:", b"note 9:"))  # same size, other bytes
        assert neutrain(resume) == 2
        line = one_error_line(capsys.readouterr().err)
        assert f"data file '{data}' is not what it was trained on" in line, line
    finally:
        data.write_bytes(original)
    (corpus,) = (again / ".cache").glob("python-stdlib-*.jsonl")
    corpus.write_bytes(corpus.read_bytes()[: corpus.stat().st_size // 2])  # cut short (a power cut, a full disk)
    assert neutrain(resume) == 0
    assert _losses(again) == _losses(out)  # steps 3 and 4 as in the uninterrupted run
