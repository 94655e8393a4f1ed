"""Outputs owned by the command that writes them: an evaluation of another model under its own name, an export
that knows the checkpoint it came from, and an interrupted ``export --overwrite`` that the next command puts back.

Before: ``neutrain eval <another model's checkpoint> --recipe R train.output_dir=RUN`` replaced RUN's
``eval_results.json``, appended unnamed rows to RUN's ``eval/metrics.jsonl`` and printed "before training
held-out loss" for a trained model; an export still named ``RUN/checkpoint-2`` after RUN was overwritten,
though that path then held other weights; a crash inside ``export --overwrite`` after the old export was
moved aside left neither, and each later command blamed something else.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from neutrain.cli import main as neutrain
from tests.helpers import finished_run, write_recipe


def _bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """Two finished tiny runs (another seed), each with checkpoint-2, an hf export and its own evaluation."""
    base = tmp_path_factory.mktemp("runs")
    outs = []
    for name, seed in (("run", 1), ("other", 2)):
        outs.append(finished_run(base / name, train={"max_steps": 2, "save_steps": 2, "seed": seed},
                                 eval={"perplexity": True}, export={"format": "hf"}))
    assert neutrain(["eval", str(outs[0].parent / "tiny.yaml")]) == 0  # RUN's own eval/eval_results.json
    return outs[0], outs[1]


TARGETS = {"another-checkpoint": ("other", "checkpoint-2"), "another-export": ("other", "export"),
           "its-own-checkpoint": ("run", "checkpoint-2")}


@pytest.mark.parametrize("target", TARGETS)
def test_an_evaluation_writes_under_the_name_of_the_model_it_evaluated(runs, capsys, target):
    run, other = runs
    owner, name = TARGETS[target]
    model = (run if owner == "run" else other) / name
    before = _bytes(run)
    argv = ["eval", str(model), f"train.output_dir={run}", "--recipe", str(run.parent / "tiny.yaml")]
    assert neutrain(argv) == 0
    said = capsys.readouterr()
    assert "held-out loss" in said.out and "before training" not in said.out + said.err
    after = _bytes(run)
    for rel in before:  # nothing the run or its own evaluation wrote is replaced or appended to
        if owner == "run" and rel == "eval/eval_results.json":
            continue  # its own model: its evaluation, replaced
        assert after.get(rel) == before[rel], rel
    # The run's data cache (its tables, built under <run>/.cache/datasets) may gain a tokenised copy: not a result.
    new = [rel for rel in after if rel not in before and not rel.startswith(".cache/datasets/")]
    if owner == "run":
        assert new == [] and str(model) in after["eval/eval_results.json"].decode()
    else:  # one file, in a folder of its own named after the model
        assert len(new) == 1 and new[0].startswith(f"eval/{model.parent.name}-{model.name}-"), new
        assert new[0].endswith("/eval_results.json") and str(model) in after[new[0]].decode()
    assert not [rel for rel in after if rel.startswith("eval/") and rel.endswith("metrics.jsonl")]


def test_an_export_says_when_its_source_checkpoint_now_holds_other_weights(tmp_path, capsys, caplog):
    recipe = write_recipe(tmp_path, train={"max_steps": 2, "save_steps": 2}, eval={"perplexity": False},
                          export={"format": "none"})
    run = tmp_path / "out"
    assert neutrain(["train", str(recipe)]) == 0
    assert neutrain(["export", str(run), "--format", "hf", "--output", str(run / "export-hf")]) == 0  # the README's
    with caplog.at_level(logging.WARNING, logger="neutrain"):
        assert neutrain(["generate", str(run / "export-hf"), "--prompt", "x", "--max-new-tokens", "1"]) == 0
    assert "now holds other weights" not in caplog.text
    assert neutrain(["train", str(recipe), "train.overwrite_output_dir=true", "train.learning_rate=1e-3"]) == 0
    assert (run / "export-hf").is_dir()  # the user's export, not the run's: kept
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="neutrain"):
        assert neutrain(["generate", str(run / "export-hf"), "--prompt", "x", "--max-new-tokens", "1"]) == 0
    assert f"was made from {run / 'checkpoint-2'}" in caplog.text and "now holds other weights" in caplog.text


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


NEXT = {  # the command after a crash inside `neutrain export RUN --overwrite`
    "generate": lambda run: ["generate", str(run / "export"), "--prompt", "x", "--max-new-tokens", "1"],
    "eval": lambda run: ["eval", str(run / "export"), "--recipe", str(run.parent / "tiny.yaml")],
    "export-again": lambda run: ["export", str(run), "--overwrite"],
    "distill-target": lambda run: ["distill", str(run.parent / "tiny.yaml"), "distill.max_steps=1"],
}


@pytest.mark.parametrize("command", NEXT)
def test_a_crash_inside_export_overwrite_is_recovered_by_the_next_command(runs, tmp_path, caplog, command):
    source, _ = runs
    run = tmp_path / "run" / "out"
    shutil.copytree(source.parent, run.parent, ignore=shutil.ignore_patterns(".neutrain.lock"))
    (run.parent / "tiny.yaml").write_text((source.parent / "tiny.yaml").read_text().replace(str(source), str(run)))
    # What the crash leaves: the previous export set aside, and its successor half-written, both under a dead pid.
    pid = _dead_pid()
    os.rename(run / "export", run / f".tmp-old-export-{pid}")
    (run / f".tmp-export-{pid}").mkdir()
    (run / f".tmp-export-{pid}" / "config.json").write_text("{")
    with caplog.at_level(logging.WARNING, logger="neutrain"):
        assert neutrain(NEXT[command](run)) == 0
    assert f"restored {run / 'export'} from .tmp-old-export-{pid}" in caplog.text
    assert (run / "export" / "config.json").is_file()
    assert not [p for p in os.listdir(run) if p.startswith(".tmp-")]
