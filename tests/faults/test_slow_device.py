"""A GPU-sized recipe on a CPU says so at once: one line before anything is built, with the predicted time
per step here and on a GPU and the recipe to use instead; ``train.allow_slow_device=true`` overrides it.

Before, ``neutrain recipes/llama3_8b.yaml`` on a 2-core CPU printed one memory line and then nothing for
more than 11 minutes while its resident memory grew past 11 GB. The shipped CPU recipes are never refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from neutrain.cli import main as neutrain
from neutrain.cli.memory import SLOW_STEP_S, check_step_time
from neutrain.cli.preflight import host_memory_available
from neutrain.config import RecipeError, load_recipe
from neutrain.memory import choose_fit
from tests.helpers import load_shipped_recipe, one_error_line

REPO = Path(__file__).resolve().parents[2]
CPU_RECIPES = ("default", "neuzip_cpu", "lora_neuzip", "long_context", "smollm2_chat")


class Built(Exception):
    """Raised where the build would begin: a refusal must come before it."""


def _no_build(*_args, **_kwargs):
    raise Built("the build began")


def test_a_gpu_recipe_on_a_cpu_is_refused_in_one_line_before_the_build(tmp_path, capsys, monkeypatch):
    import neutrain.cli.train as train

    monkeypatch.setattr(train, "build_trainer", _no_build)  # the tokenizer, the data and the 8B model
    rc = neutrain(["recipes/llama3_8b.yaml", "train.use_cpu=true", f"train.output_dir={tmp_path / 'out'}"])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2
    assert line.startswith("neutrain: error: train.allow_slow_device: recipes/llama3_8b.yaml is a GPU recipe: a step "
                           "is predicted to take "), line
    minutes = line.split("is predicted to take ", 1)[1].split(" on this CPU", 1)[0]
    assert "min" in minutes or " h " in minutes  # minutes a step here
    assert " s on an H200 with " in line and " GiB of GPU memory" in line  # the GPU it was written for
    assert line.endswith("on a CPU use recipes/default.yaml, or set train.allow_slow_device=true to train here anyway")


def test_the_key_lets_a_slow_run_go_on_and_the_cpu_recipes_are_never_refused():
    eight_b = load_recipe(REPO / "recipes" / "llama3_8b.yaml", ["train.use_cpu=true"])
    fit = choose_fit(eight_b, None, host_memory_available(), gpu=False)
    assert fit.step.step_s > SLOW_STEP_S
    with pytest.raises(RecipeError, match=r"^train\.allow_slow_device: "):
        check_step_time(eight_b, fit, gpu=False)
    check_step_time(eight_b, fit, gpu=True)  # on a GPU: the H200's rates, never refused
    allowed = load_recipe(REPO / "recipes" / "llama3_8b.yaml", ["train.use_cpu=true", "train.allow_slow_device=true"])
    check_step_time(allowed, choose_fit(allowed, None, host_memory_available(), gpu=False), gpu=False)
    for name in CPU_RECIPES:
        recipe = load_shipped_recipe(REPO / "recipes" / f"{name}.yaml")
        if recipe is None:  # a model of an optional package that is not installed
            continue
        fit = choose_fit(recipe, None, host_memory_available(), gpu=False)
        check_step_time(recipe, fit, gpu=False)
        assert fit.step.step_s < SLOW_STEP_S / 10, (name, fit.line)  # far from the threshold: seconds a step
