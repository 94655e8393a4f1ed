"""The run summary's outputs line names what the run left, never a checkpoint it did not save.

Why: a run with ``train.save_steps`` past ``train.max_steps`` and ``train.save_final: false`` saves no checkpoint,
yet its summary said "outputs RUN (checkpoints, metrics.jsonl, training_curves.png)".
"""

from __future__ import annotations

import pytest

from tests.helpers import write_recipe


@pytest.mark.parametrize("saves,expected", [
    ({"save_steps": 100, "save_final": False}, "no checkpoint"),
    ({"save_steps": 2}, "checkpoint-2, checkpoint-4"),
])
def test_the_outputs_line_names_the_checkpoints_the_run_saved(tmp_path, capsys, saves, expected):
    from neutrain.cli import main

    recipe = write_recipe(tmp_path, train={"max_steps": 4, **saves}, eval={"perplexity": False},
                          export={"format": "none"})
    assert main(["train", str(recipe)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("outputs"))
    assert expected in line and "metrics.jsonl" in line, line
    if "no checkpoint" in expected:
        assert "checkpoints" not in line, line
