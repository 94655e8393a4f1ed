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


def _plot(out):
    """What the trainer runs at the end of training and after each evaluation: read metrics.jsonl, draw the PNG."""
    from types import SimpleNamespace

    from neutrain.trainer.callbacks import PlotCallback

    PlotCallback().on_train_end(SimpleNamespace(output_dir=str(out)), SimpleNamespace(is_world_process_zero=True), None)
    return out / "training_curves.png"


def test_an_oversized_metrics_file_is_plotted_from_its_tail_in_bounded_memory(tmp_path, caplog):
    import tracemalloc

    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "wb") as fh:
        fh.truncate(256 << 20)  # a long run's records, as holes: no disk, and nothing to read but its size
        fh.seek(0, 2)
        fh.write(b"\n" + b"".join(json.dumps({"step": s, "loss": 1.0 / s}).encode() + b"\n" for s in (9000, 9001)))
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="neutrain"):
            png = _plot(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 128 << 20, f"{peak:,} bytes held to plot the tail of a 256 MiB metrics file"
    assert png.is_file()
    assert [r["step"] for r in read_metrics(metrics)] == [9000, 9001]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and str(metrics) in warnings[0] and "from step 9000 on" in warnings[0], warnings


def test_a_fifo_metrics_file_is_no_plot_and_no_hang(tmp_path, caplog):
    import os

    from tests.faults.test_json_reads import _no_hang

    metrics = tmp_path / "metrics.jsonl"
    os.mkfifo(metrics)
    with _no_hang(metrics, seconds=5.0), caplog.at_level(logging.WARNING, logger="neutrain"):
        png = _plot(tmp_path)
    assert not png.exists()
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [f"metrics file '{metrics}' is a FIFO (named pipe), not a regular file: no metrics read"], warnings
