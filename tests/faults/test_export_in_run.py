"""A run's export inside its own folder is refused at a name the run writes itself, and works anywhere else there.

Before: ``export.output_dir=RUN/tokenizer`` (or ``RUN/checkpoint-2``, ``RUN/eval``, ...) trained the whole run, then
found the run's own files there and refused the export, exit 2 with no summary; ``export.output_dir=RUN/mine/sub``
trained the whole run, then refused ``RUN/mine`` as "exists and this run did not write it": the export's lock, beside
the export, had made that folder at the start, unclaimed. The table crosses every name a run writes
(:data:`neutrain.storage.confine.RUN_FILES`, a checkpoint, the run's lock and temporaries).
"""

from __future__ import annotations

import copy

import pytest

from neutrain.cli import main
from neutrain.cli.outputs import check_output_places
from neutrain.config import RecipeError, validate_recipe
from neutrain.storage.confine import RUN_FILES
from tests.helpers import TINY_RECIPE, write_recipe

TAKEN = [name for name in RUN_FILES if name != "export"] + ["checkpoint-2", ".neutrain.lock", ".neutrain-run",
                                                            ".tmp-checkpoint-2"]


@pytest.mark.parametrize("name", TAKEN)
@pytest.mark.parametrize("depth", ["at", "under"])
def test_an_export_at_a_name_the_run_writes_is_refused_before_training(tmp_path, name, depth):
    raw = copy.deepcopy(TINY_RECIPE)
    out = tmp_path / "out"
    export = out / name / ("sub" if depth == "under" else "")
    raw["train"]["output_dir"], raw["export"]["output_dir"] = str(out), str(export)
    with pytest.raises(RecipeError) as refused:
        check_output_places(validate_recipe(raw))
    message = str(refused.value)
    assert message.startswith(f"export.output_dir '{export}' is where the run in '{out}' writes its own '{name}'")
    assert "\n" not in message


@pytest.mark.parametrize("place", ["export", "export/sub", "mine", "mine/sub"])
def test_an_export_elsewhere_in_the_run_is_the_runs_own(tmp_path, place):
    raw = copy.deepcopy(TINY_RECIPE)
    raw["train"]["output_dir"], raw["export"]["output_dir"] = str(tmp_path / "out"), str(tmp_path / "out" / place)
    check_output_places(validate_recipe(raw))


@pytest.mark.slow  # one training step: the refusal came after the training, so only a run shows it gone
def test_an_export_two_folders_deep_in_the_run_is_written_after_training(tmp_path):
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path, train={"max_steps": 1, "save_steps": 1}, eval={"perplexity": False},
                          export={"format": "hf", "output_dir": str(out / "mine" / "sub")})
    assert main(["train", str(recipe)]) == 0
    assert (out / "mine" / "sub" / "neutrain_export.json").is_file() and (out / "summary.json").is_file()
