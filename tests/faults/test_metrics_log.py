"""A torn last line in ``metrics.jsonl`` (a disk-full or killed run) is reported, not fatal.

Before: the next resume trained, saved its final checkpoint, then crashed in
``callbacks.read_metrics`` (no summary, no export), and a relaunch then said "run already
finished". Now the line is skipped with one warning naming the file and the line, the
resumed run's records start on a line of their own, and the run ends with its summary.
"""

from __future__ import annotations

import json
import logging

from neutrain.cli import main as neutrain
from neutrain.trainer.callbacks import read_metrics
from tests.helpers import write_recipe


def test_a_torn_last_metrics_line_is_reported_and_the_resume_finishes(tmp_path, caplog):
    recipe = write_recipe(tmp_path, train={"max_steps": 2, "save_steps": 2},
                          eval={"perplexity": False}, export={"format": "hf"})
    out = tmp_path / "out"
    assert neutrain(["train", str(recipe)]) == 0
    metrics = out / "metrics.jsonl"
    with open(metrics, "a") as fh:
        fh.write('{"step": 2, "loss": 5.1, "learning_ra')  # the disk filled up mid-line
    torn_line = len(metrics.read_text().splitlines())
    (out / "summary.json").unlink()
    with caplog.at_level(logging.WARNING, logger="neutrain"):
        assert neutrain(["train", str(recipe), "train.max_steps=4", "train.resume_from_checkpoint=true"]) == 0
    warnings = [r.getMessage() for r in caplog.records if "not a complete metrics record" in r.getMessage()]
    assert warnings == [f"{metrics}: line {torn_line} is not a complete metrics record (torn by a full disk or a kill): "
                        f"skipped"], warnings
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    assert (out / "export" / "model.safetensors").is_file() and (out / "training_curves.png").is_file()
    assert [r["step"] for r in read_metrics(metrics) if "loss" in r] == [1, 2, 3, 4]
    lines = metrics.read_text().splitlines()
    assert lines[torn_line - 1].endswith('"learning_ra') and json.loads(lines[torn_line])["step"] == 3
