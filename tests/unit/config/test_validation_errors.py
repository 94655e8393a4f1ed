"""pydantic's errors as the recipe's one line: which error of several comes first, and the path it names."""

from __future__ import annotations

import copy

import pytest

from neutrain.config import RecipeError, section_from, validate_recipe
from tests.helpers import TINY_RECIPE


@pytest.mark.parametrize("section, values, line", [
    # A section's unknown key before its missing ones, and both before any value.
    ("train", {"seed": -1, "learning_rat": 1e-3}, "train: unknown key 'learning_rat'. Did you mean 'learning_rate'?"),
    ("data", {"datasets": [{"pth": "x"}]}, "data.datasets[0]: unknown key 'pth'. Did you mean 'path'?"),
    ("data", {"datasets": [{"type": "text"}]}, "data.datasets[0]: missing required key 'path'"),
    # Keys in their declared order, whatever order the recipe gives them in.
    ("train", {"seed": -1, "learning_rate": -1}, "train.learning_rate: -1.0 must be greater than 0.0"),
    # Of a union's members, the error deepest in the value; a member's tag is no part of the path.
    ("train", {"report_to": ["none", 1]}, "train.report_to[1]: expected a string, got int 1"),
    ("model", {"config": 5}, "model.config: expected a mapping or a string, got int 5"),
    ("data", {"datasets": [5]}, "data.datasets[0]: expected a mapping, got int"),
    ("data", {"datasets": [{"path": "python-stdlib", "max_files": 0}]},
     "data.datasets[0].max_files: 0 is below the minimum 1"),
    # A 400-digit number is cut, as any long value is.
    ("data", {"max_samples": 10**400}, f"data.max_samples: {'1' + '0' * 56}... is above the maximum 2,147,483,647"),
])
def test_the_first_error_is_the_line(section, values, line):
    raw = copy.deepcopy(TINY_RECIPE)
    raw[section] = {**raw.get(section, {}), **values} if section != "data" else {**raw["data"], **values}
    with pytest.raises(RecipeError) as err:
        validate_recipe(raw)
    assert str(err.value) == line


def test_a_lone_section_names_its_keys_as_a_recipe_would():
    with pytest.raises(RecipeError) as err:
        section_from("train", {"seed": -1, "learning_rat": 1e-3})
    assert str(err.value) == "train: unknown key 'learning_rat'. Did you mean 'learning_rate'?"
    with pytest.raises(RecipeError) as err:
        section_from("memory", {"lora_target_modules": ["q_proj", 2]})
    assert str(err.value) == "memory.lora_target_modules[1]: expected a string, got int 2"
