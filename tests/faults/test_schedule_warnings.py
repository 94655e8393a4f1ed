"""A learning-rate schedule that cannot do what the recipe says is said before training.

Why: ``train.warmup_steps: 100`` in a run of ``train.max_steps: 4`` trained at most 4% of ``train.learning_rate``
(3e-3 became 1.2e-4) with no word; under ``train.lr_scheduler: constant`` the warm-up is ignored by the scheduler.
"""

from __future__ import annotations

import logging

import pytest

from tests.helpers import write_recipe

CASES = [  # overrides, the words of the warning (None: no warning)
    (["train.warmup_steps=100", "train.max_steps=4"], "never reaches train.learning_rate"),
    (["train.warmup_steps=4", "train.max_steps=4"], "never reaches train.learning_rate"),
    (["train.warmup_steps=3", "train.max_steps=4"], None),
    (["train.lr_scheduler=constant", "train.warmup_steps=2"], "ignores train.warmup_steps"),
    (["train.lr_scheduler=constant_with_warmup", "train.warmup_steps=2"], None),
    (["train.lr_scheduler=constant", "train.warmup_steps=0"], None),
]


@pytest.mark.parametrize("overrides,words", CASES)
def test_a_schedule_that_cannot_do_what_the_recipe_says_is_warned_about(tmp_path, caplog, overrides, words):
    from neutrain.cli.advice import warn_about_settings
    from neutrain.config import load_recipe

    recipe = load_recipe(str(write_recipe(tmp_path)), overrides)
    with caplog.at_level(logging.WARNING, logger="neutrain"):
        warn_about_settings(recipe)
    if words is None:
        assert "warmup" not in caplog.text, caplog.text
    else:
        assert words in caplog.text and "train.warmup_steps" in caplog.text, caplog.text
