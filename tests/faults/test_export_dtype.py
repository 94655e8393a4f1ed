"""An export dtype is written or refused before anything runs, never ignored: NeuZip keeps the weights' dtype.

``export.format: neuzip`` with ``export.dtype: float16`` trained the whole run and then wrote float32 weights;
``neutrain export CKPT --format neuzip --dtype float16`` wrote float32 and printed "dtype float16". Every
format a recipe or the command takes, against every dtype: a NeuZip format with a dtype other than ``auto``
is one line naming the key or flag, exit 2, before the model is built or the checkpoint read.
"""

from __future__ import annotations

import re

import pytest

from neutrain.cli import main as run_command
from neutrain.config.schema import SCHEMA
from neutrain.export import LOSSY_KS
from tests.helpers import write_recipe

RECIPE_FORMATS = [f for f in SCHEMA["export"]["format"].choices if f != "none"]
COMMAND_FORMATS = sorted({*RECIPE_FORMATS, "neuzip-lossless", *(f"neuzip-lossy-{k}" for k in LOSSY_KS)})
DTYPES = list(SCHEMA["export"]["dtype"].choices)


def _ignored(fmt: str, dtype: str) -> bool:
    return fmt.startswith("neuzip") and dtype != "auto"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", RECIPE_FORMATS)
def test_a_recipe_export_dtype_its_format_would_ignore_is_refused_at_load(tmp_path, fmt, dtype):
    from neutrain.config import load_recipe
    from neutrain.errors import RecipeError

    recipe = str(write_recipe(tmp_path))
    overrides = [f"export.format={fmt}", f"export.dtype={dtype}"]
    if not _ignored(fmt, dtype):
        assert load_recipe(recipe, overrides).export.dtype == dtype
        return
    with pytest.raises(RecipeError, match=rf"^export\.dtype: {dtype} would be ignored by export\.format {fmt} "):
        load_recipe(recipe, overrides)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "auto"])
@pytest.mark.parametrize("fmt", [f for f in COMMAND_FORMATS if f.startswith("neuzip")])
def test_an_export_command_dtype_its_format_would_ignore_is_refused_before_the_checkpoint_is_read(
        tiny_run, tmp_path, capsys, monkeypatch, fmt, dtype):
    import neutrain.cli.export

    def loaded(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the refusal")

    monkeypatch.setattr(neutrain.cli.export, "load_model_checkpoint", loaded)
    out = tmp_path / "export"
    code = run_command(["export", str(tiny_run / "checkpoint-2"), "--format", fmt, "--dtype", dtype, "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and re.fullmatch(rf"neutrain: error: --dtype: {dtype} would be ignored by --format {fmt} .*\n", err), err
    assert not out.exists()
