"""The literal launch line: `accelerate launch --cpu recipes/default.yaml train.max_steps=2` trains, exactly so.

Accelerate runs the recipe file with python; the installed ``neutrain-recipe.pth`` registers the
codec that turns it into ``neutrain train <file> <args>`` (neutrain/config/recipe_codec.py).
These tests need the package installed (``pip install -e .`` or ``pip install .``): they fail,
saying so, where only PYTHONPATH provides neutrain.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from neutrain.config import recipe_codec
from tests.helpers import free_port, write_recipe

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _env():
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", DISABLE_TQDM="1", NEUTRAIN_LOG_LEVEL="WARNING",
               PATH=str(BIN) + os.pathsep + env.get("PATH", ""))
    if env.get("PYTHONPATH"):  # a development checkout on PYTHONPATH: keep it ahead of any other installed copy
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env["PYTHONPATH"]
    return env


@pytest.fixture(scope="module")
def installed_codec():
    res = subprocess.run([sys.executable, "-c", f"import codecs; codecs.lookup({recipe_codec.NAME!r})"],
                         capture_output=True, text=True, env=_env(), timeout=120)
    if res.returncode != 0:
        pytest.fail(f"the '{recipe_codec.NAME}' codec is not registered in {sys.executable}'s environment: "
                    "neutrain-recipe.pth is not installed; reinstall with `pip install -e .`\n" + res.stderr[-500:])


def _executable_recipe(tmp_path: Path, **sections) -> Path:
    recipe = write_recipe(tmp_path, **sections)
    lines = recipe.read_text().splitlines(keepends=True)
    recipe.write_text("".join([lines[0], f"# coding: {recipe_codec.NAME}\n", *lines[1:]]))
    return recipe


def test_literal_accelerate_launch_of_the_default_recipe(tmp_path, installed_codec):
    accelerate = shutil.which("accelerate", path=str(BIN))
    assert accelerate, f"no accelerate console script beside {sys.executable}"
    (tmp_path / "recipes").mkdir()
    shutil.copy2(REPO / "recipes" / "default.yaml", tmp_path / "recipes" / "default.yaml")  # keeps its mode
    # The command exactly as documented, run where recipes/ is; the recipe's output_dir lands in tmp_path.
    res = subprocess.run("accelerate launch --cpu recipes/default.yaml train.max_steps=2", shell=True, cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-4000:]
    summary = json.loads((tmp_path / "outputs" / "default" / "summary.json").read_text())
    assert summary["steps"] == 2, summary
    assert "neutrain run summary" in res.stdout


def test_python_on_a_bad_recipe_prints_one_line_and_exits_2(tmp_path, installed_codec):
    recipe = _executable_recipe(tmp_path, train={"learning_rat": 1e-3})
    res = subprocess.run([sys.executable, str(recipe)], capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("neutrain: error: "), res.stderr
    assert "unknown key 'learning_rat'" in lines[0] and "Traceback" not in res.stderr
    # A bad override given on the launch line is named the same way.
    ok = _executable_recipe(tmp_path / "ok")
    res = subprocess.run([sys.executable, str(ok), "train.max_stepz=2"], capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 2 and "max_stepz" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_torchrun_two_processes_run_the_recipe_file(tmp_path, installed_codec):
    recipe = _executable_recipe(tmp_path, train={"max_steps": 2, "save_steps": 2}, export={"format": "none"},
                                eval={"perplexity": False})
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                          str(recipe)], capture_output=True, text=True, env=_env(), timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2, summary
