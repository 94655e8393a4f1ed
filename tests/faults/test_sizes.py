"""Sizes are checked before anything is allocated or built: one line, exit 2.

Before: ``model.config`` with ``hidden_size`` or ``vocab_size`` of 1e9 failed in the
allocator with a traceback, ``num_hidden_layers: 1000000`` hung while building, and a YAML alias bomb
hung in the first save of ``recipe.yaml``. The preflight now compares the weights' bytes (the planner's
model shape, in closed form) with the host or GPU memory, bounds the layer count, and the recipe
reader bounds alias expansion and the file's size.
"""

from __future__ import annotations

import time

import pytest

from neutrain.cli import main as neutrain
from tests.faults.test_data_errors import _no_progress_bars, _one_line_error  # noqa: F401 (fixture)
from tests.faults.test_run_lifecycle import QUIET
from tests.helpers import TINY_LLAMA, write_recipe


def _never_built(monkeypatch):
    import neutrain.trainer.modeling as modeling

    monkeypatch.setattr(modeling, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    monkeypatch.setattr(modeling, "build_tokenizer", lambda *a, **k: pytest.fail("the tokenizer was built"))


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size"])
def test_a_huge_dimension_is_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch, key):
    _never_built(monkeypatch)
    recipe = write_recipe(tmp_path, model={"config": {**TINY_LLAMA, key: 1_000_000_000}}, **QUIET)
    line = _one_line_error(capsys, ["train", str(recipe)])
    assert line.startswith("neutrain: error: model.config: the weights alone need about ") and "GiB of host memory" in line
    assert f"{key} 1,000,000,000" in line


def test_a_million_layers_is_refused_at_once(tmp_path, capsys, monkeypatch):
    _never_built(monkeypatch)
    recipe = write_recipe(tmp_path, model={"config": {**TINY_LLAMA, "num_hidden_layers": 1_000_000}}, **QUIET)
    started = time.perf_counter()
    line = _one_line_error(capsys, ["train", str(recipe)])
    assert "model.config.num_hidden_layers: 1,000,000 layers is beyond neutrain's bound" in line
    assert time.perf_counter() - started < 30


def test_the_weights_are_compared_with_the_gpu_for_a_gpu_run():
    from neutrain.cli.preflight import check_model_size
    from neutrain.config import load_recipe
    from neutrain.errors import RecipeError

    recipe = load_recipe("default", ["train.use_cpu=false", "model.dtype=bfloat16"])
    check_model_size(recipe, host_bytes=1 << 20, device_bytes=80 << 30)  # host memory is not where they live
    with pytest.raises(RecipeError, match="GiB of GPU memory"):
        check_model_size(recipe, host_bytes=1 << 40, device_bytes=1 << 20)


def _alias_bomb(levels: int) -> str:
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_in_model_config_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    from neutrain.config.recipe_yaml import MAX_RECIPE_VALUES

    _never_built(monkeypatch)
    recipe = write_recipe(tmp_path, **QUIET)
    text = recipe.read_text().replace("  config:\n", "  config:\n    bomb: *l8\n", 1)
    recipe.write_text("x-anchors:\n" + "".join("  " + line + "\n" for line in _alias_bomb(9).splitlines()) + text)
    started = time.perf_counter()
    line = _one_line_error(capsys, ["train", str(recipe)])
    assert f"its YAML aliases expand to more than {MAX_RECIPE_VALUES:,} values" in line
    assert time.perf_counter() - started < 30
    assert not (tmp_path / "out").exists()


def test_ordinary_aliases_and_merges_still_load(tmp_path):
    from neutrain.config.recipe_yaml import parse_recipe_text

    assert parse_recipe_text(b"base: &b {lr: 1}\nrun:\n  <<: *b\n  steps: 2\ncopy: *b\n", "r.yaml") == {
        "base": {"lr": 1}, "run": {"lr": 1, "steps": 2}, "copy": {"lr": 1}}
    assert parse_recipe_text(_alias_bomb(4).encode(), "r.yaml")["l3"][0][0][0][0] == "x"  # 10,000 values: a big but fine recipe
