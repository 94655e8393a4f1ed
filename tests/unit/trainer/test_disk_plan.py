"""The path-length check agrees with the file system, and the save count with the Trainer's schedule.

Before: nothing measured a planned path; the first too-long name was met at the export's staging, after
the training.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neutrain.config import load_recipe
from neutrain.errors import RecipeError
from neutrain.trainer.disk_plan import check_path_lengths, planned_paths, planned_saves


def _creatable(path: str, below: Path) -> bool:
    """Whether every name of ``path`` under ``below`` can be created on this file system."""
    try:
        os.makedirs(path, exist_ok=True)
        return True
    except OSError:
        return False


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.integers(200, 262), key=st.sampled_from(["export.output_dir", "train.output_dir"]))
def test_a_folder_is_refused_exactly_when_one_of_its_planned_paths_cannot_be_created(tmp_path_factory, length, key):
    root = tmp_path_factory.mktemp("names")
    name = str(root / ("n" * length))
    overrides = [f"train.output_dir={name}" if key == "train.output_dir" else f"train.output_dir={root / 'out'}",
                 "export.format=hf", "train.max_steps=10"]
    if key == "export.output_dir":
        overrides.append(f"export.output_dir={name}")
    try:
        recipe = load_recipe("default", overrides)
    except RecipeError as exc:  # the folder's own name is past NAME_MAX: refused where the value enters
        assert str(exc).startswith(f"{key}: ") and not _creatable(name, root), (length, str(exc))
        return
    try:
        check_path_lengths(recipe)
        refused = None
    except RecipeError as exc:
        refused = str(exc)
    fits = all(_creatable(path, root) for path in planned_paths(recipe)[key])
    assert (refused is None) == fits, (length, refused)
    if refused:
        assert refused.startswith(f"{key}: ")


@pytest.mark.parametrize("start,max_steps,save_steps,final,expected", [
    (0, 10, 4, True, 3),   # 4, 8 and the last step
    (0, 10, 5, True, 2),   # 5 and 10: the last step is a save step already
    (0, 10, 4, False, 2),  # 4, 8
    (0, 10, 20, False, 0),  # a benchmark: nothing
    (0, 10, 20, True, 1),  # only the last step
    (8, 10, 4, True, 1),   # resumed at 8: the last step only
    (10, 10, 4, True, 0),  # finished
])
def test_the_saves_a_run_plans_are_the_trainers(start, max_steps, save_steps, final, expected):
    assert planned_saves(start, max_steps, save_steps, final) == expected
