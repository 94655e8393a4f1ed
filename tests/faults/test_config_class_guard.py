"""A model-config value the config class fails on anywhere, its writing-out included, is one line naming the config.

The class was asked to build the config inside a guard, but its ``to_dict`` (how config.json is written beside
every checkpoint) ran outside it: a ``torch_dtype`` of ``[]`` or ``1e-300`` ended in an ``IndexError``
traceback at load. The table gives the guarded classes values of every JSON kind under keys they convert.
"""

from __future__ import annotations

import copy

import pytest

from neutrain.config import RecipeError, validate_recipe
from tests.helpers import TINY_LLAMA, TINY_RECIPE

VALUES = [[], {}, 1e-300, -1, "", "float33", [1, 2], {"a": 1}, True]


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
@pytest.mark.parametrize("value", VALUES, ids=[repr(v) for v in VALUES])
def test_a_config_value_the_class_cannot_write_is_one_line(tmp_path, key, value):
    raw = copy.deepcopy(TINY_RECIPE)
    raw["train"]["output_dir"] = str(tmp_path / "out")
    raw["model"]["config"] = {**TINY_LLAMA, key: value}
    try:
        validate_recipe(raw)
    except RecipeError as exc:
        assert str(exc).startswith("model.config") and "\n" not in str(exc), str(exc)
