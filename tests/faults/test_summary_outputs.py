"""The run summary's outputs line names what the run left, never a checkpoint it did not save.

Why: a run with ``train.save_steps`` past ``train.max_steps`` and ``train.save_final: false`` saves no checkpoint,
yet its summary said "outputs RUN (checkpoints, metrics.jsonl, training_curves.png)"; and such a run with no export
writes its trained weights nowhere, which only that summary said, after the whole run: it is warned about first.
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


# A run that keeps nothing is said before it trains, not only by its summary at the end.
@pytest.mark.parametrize("overrides,warned", [
    (["train.save_steps=100", "train.save_final=false", "export.format=none"], True),
    (["train.save_steps=5", "train.save_final=false", "export.format=none"], True),
    (["train.save_steps=4", "train.save_final=false", "export.format=none"], False),  # step 4 is a multiple
    (["train.save_steps=3", "train.save_final=false", "export.format=none"], False),
    (["train.save_steps=100", "train.save_final=true", "export.format=none"], False),
    (["train.save_steps=100", "train.save_final=false", "export.format=hf"], False),
    (["train.save_steps=100", "train.save_final=false", "export.format=neuzip"], False),
    (["train.save_steps=100", "train.save_final=false", "export.format=none", "train.max_steps=-1"], False),
])
def test_a_run_that_would_write_its_weights_nowhere_is_warned_about_before_training(tmp_path, caplog, overrides,
                                                                                     warned):
    import logging

    from neutrain.cli.advice import warn_about_settings
    from neutrain.config import load_recipe

    recipe = load_recipe(str(write_recipe(tmp_path, train={"max_steps": 4})), overrides)
    with caplog.at_level(logging.WARNING, logger="neutrain"):
        warn_about_settings(recipe)
    said = "the trained weights are written nowhere" in caplog.text
    assert said == warned, caplog.text
    if warned:
        assert "train.save_steps" in caplog.text and "export.format" in caplog.text
