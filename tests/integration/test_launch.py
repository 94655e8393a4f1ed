"""Launching: accelerate launch -m neutrain, --no_python with a shebang recipe, and 2 gloo processes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import free_port, write_recipe

REPO = Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", DISABLE_TQDM="1", NEUTRAIN_LOG_LEVEL="WARNING",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), PATH=bindir + os.pathsep + env.get("PATH", ""))
    return env


def _run(cmd, **kw):
    return subprocess.run([str(c) for c in cmd], env=_env(), capture_output=True, text=True, timeout=900, **kw)


def _train_in_process(recipe) -> None:
    """``neutrain train RECIPE`` in this process (the CLI's own path, without an interpreter's start-up), on one
    thread as the launched processes run (``OMP_NUM_THREADS=1``): the same sums in the same order. For the
    one-process reference runs that launched runs are compared with; the launches themselves stay literal."""
    from neutrain.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", str(recipe)]) == 0
    finally:
        torch.set_num_threads(threads)


def _summary(tmp_path):
    return json.loads((tmp_path / "out" / "summary.json").read_text())


QUICK = {"max_steps": 2, "save_steps": 2}


def test_accelerate_launch_module(tmp_path):
    recipe = write_recipe(tmp_path, train=QUICK, export={"format": "none"})
    res = _run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "-m", "neutrain", recipe])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "neutrain run summary" in res.stdout
    assert _summary(tmp_path)["steps"] == 2


@pytest.mark.skipif(shutil.which("neutrain", path=str(Path(sys.executable).parent)) is None, reason="console script not installed")
def test_accelerate_launch_no_python_shebang_recipe(tmp_path):
    recipe = write_recipe(tmp_path, train=QUICK, export={"format": "none"})
    assert os.access(recipe, os.X_OK)
    res = _run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--no_python", recipe])
    assert res.returncode == 0, res.stderr[-3000:]
    assert _summary(tmp_path)["steps"] == 2


def _final_weights(out: Path):
    return load_file(str(out / "checkpoint-3" / "model.safetensors"))


def test_two_gloo_processes_match_one_process(tmp_path):
    """2 processes x micro-batch 2 == 1 process x micro-batch 4 (same global batch), within rtol 1e-5."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    common = {"max_steps": 3, "save_steps": 3, "logging_steps": 1}
    r1 = write_recipe(one, train={**common, "micro_batch_size": 4}, export={"format": "none"}, eval={"perplexity": False})
    r2 = write_recipe(two, train={**common, "micro_batch_size": 2}, export={"format": "none"}, eval={"perplexity": False})
    _train_in_process(r1)
    res = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "neutrain", r2])
    assert res.returncode == 0, res.stderr[-3000:]
    assert _summary(one)["world_size"] == 1
    assert _summary(two)["world_size"] == 2, "the distributed run did not really use 2 processes"
    w1, w2 = _final_weights(one / "out"), _final_weights(two / "out")
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-5, atol=1e-7, msg=name)
    # The weights must have moved for the comparison to mean anything.
    losses_one = [json.loads(line)["loss"] for line in (one / "out" / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(losses_one) == 3 and losses_one[-1] != losses_one[0]
